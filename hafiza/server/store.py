"""The KV store in the server: the `hafiza serve --store-*` options (checked before the model loads), the
connector they build and attach to the engine before the engine thread starts (`connect_store`), and the store
seen from the HTTP app: its metrics on /metrics, its tiers for the dashboard, and its pending writes flushed when
the app shuts down (`serve_store`)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from fastapi import FastAPI
from prometheus_client.registry import CollectorRegistry
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hafiza.engine.engine import LLMEngine
from hafiza.errors import ConfigError
from hafiza.server.state import ServerState
from hafiza.server.store_metrics import ConnectorCollector, register_store_metrics
from hafiza.store.codecs import DEFAULT_STORE_CODEC, check_codec
from hafiza.store.config import StoreConfigError, build_tiers, parse_disk_spec, parse_redis_url, parse_size
from hafiza.store.connector import StoreConnector
from hafiza.store.redis_store import DEFAULT_TTL_S

log = logging.getLogger("hafiza.store")


@dataclass(frozen=True)
class StoreOptions:
    """The `hafiza serve --store-*` options."""

    ram: str | None = None
    disk: str | None = None
    redis: str | None = None
    codec: str = DEFAULT_STORE_CODEC
    write_back: bool = False
    tier_codecs: tuple[tuple[str, str], ...] = ()  # (tier name, codec) where a tier differs from `codec`

    @property
    def enabled(self) -> bool:
        return any(x is not None for x in (self.ram, self.disk, self.redis))

    def validate(self) -> None:
        """Raise a one-line HafizaError for a bad option, before the model is loaded."""
        check_codec(self.codec)
        for tier, codec in self.tier_codecs:
            try:
                check_codec(codec)
            except ConfigError as exc:
                raise StoreConfigError(str(exc), setting=f"store_{tier}_codec") from None
            if getattr(self, tier) is None:
                raise StoreConfigError(f"--store-{tier}-codec needs --store-{tier}")
        if self.write_back and len({c for _, c in self.tier_codecs} | {self.codec}) > 1:
            raise StoreConfigError("--store-write-back needs one codec for every tier (RAM entries are written "
                                   "down as they are)")
        if self.ram is not None:
            try:
                parse_size(self.ram)
            except ConfigError as exc:
                raise StoreConfigError(f"RAM tier: {exc}", setting="store_ram") from None
        if self.disk is not None:
            parse_disk_spec(self.disk)
        if self.redis is not None:
            parse_redis_url(self.redis)
        if self.write_back and self.ram is None:
            raise StoreConfigError("--store-write-back needs --store-ram (blocks wait in RAM until written down)")


def connect_store(engine: LLMEngine, options: StoreOptions) -> StoreConnector:
    """Build the tiers and attach a connector to `engine`; call it before the engine's thread starts (only that
    thread touches the engine afterwards)."""
    options.validate()
    store = build_tiers(options.ram, options.disk, options.redis, write_back=options.write_back)
    ttl = parse_redis_url(options.redis).ttl_s if options.redis else DEFAULT_TTL_S
    connector = StoreConnector.for_engine(engine, store, codec=options.codec, tier_codecs=dict(options.tier_codecs),
                                          default_ttl_s=ttl)
    engine.attach_connector(connector)
    return connector


class FlushOnShutdown:
    """Pure ASGI middleware: flush pending store writes before the app reports its shutdown complete.

    uvicorn shuts down gracefully on SIGTERM and SIGINT, then re-raises the signal: with SIGTERM the process
    ends there, so the lifespan shutdown is the last point where the writes can be finished."""

    def __init__(self, app: ASGIApp, connector: StoreConnector, timeout_s: float = 30.0) -> None:
        self.app, self.connector, self.timeout_s = app, connector, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def send_after_flush(message: Message) -> None:
            if message["type"] == "lifespan.shutdown.complete":
                await asyncio.to_thread(self._flush)
            await send(message)

        await self.app(scope, receive, send_after_flush)

    def _flush(self) -> None:
        t0 = time.monotonic()
        if self.connector.flush(self.timeout_s):
            log.info("store: pending writes flushed at shutdown in %.2f s", time.monotonic() - t0)
        else:
            log.error("store: pending writes not flushed within %.0f s at shutdown; some blocks are lost",
                      self.timeout_s)


def serve_store(app: FastAPI, connector: StoreConnector, registry: CollectorRegistry | None = None) -> None:
    """Expose an attached store: its tiers' and the connector's metrics on `registry` (default: the app's), the
    connector on the server state (the dashboard's tier view), and a flush of pending writes at shutdown."""
    state: ServerState = app.state.hafiza
    if state.aengine.engine.connector is not connector:
        raise ValueError("attach the connector to the engine (before the engine thread starts) first")
    state.store = connector
    registry = registry or state.metrics.registry
    register_store_metrics(registry, connector.store)
    registry.register(ConnectorCollector(connector))
    app.add_middleware(FlushOnShutdown, connector=connector)
