"""The tiered store inside `hafiza serve`: build the tiers from the CLI options, attach the connector to the
engine, export store metrics on the server's registry, and say per request where its prompt came from.

Every HTTP response that names an engine request (`request-id` or `x-request-id`) gets an `x-hafiza-tiers`
header next to `x-hafiza-cache`, e.g.
`decision=load; pool=0; disk=1984; computed=16; why=load: 28.95 MB from disk at 950 MB/s ~ 30.5 ms < ...`:
tokens from the engine's own pool, from each store tier, and computed; `decision` is load, recompute, miss
(no tier held the next block) or none (the pool alone covered the prompt, or no lookup was needed).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from hafiza.engine.engine import RequestOutput
from hafiza.errors import ConfigError
from hafiza.store.codecs import DEFAULT_STORE_CODEC, check_codec
from hafiza.store.config import StoreConfigError, build_tiers, parse_disk_spec, parse_redis_url, parse_size
from hafiza.store.connector import StoreConnector
from hafiza.store.metrics import register_store_metrics
from hafiza.store.redis_store import DEFAULT_TTL_S

if TYPE_CHECKING:
    from fastapi import FastAPI

    from hafiza.engine.async_engine import AsyncEngine

log = logging.getLogger("hafiza.store")
HEADER = "x-hafiza-tiers"
_ASCII = str.maketrans({"≈": "~", "≤": "<=", "≥": ">=", "×": "x", "→": "->"})


@dataclass(frozen=True)
class StoreOptions:
    """The `hafiza serve --store-*` options."""

    ram: str | None = None
    disk: str | None = None
    redis: str | None = None
    codec: str = DEFAULT_STORE_CODEC
    write_back: bool = False

    @property
    def enabled(self) -> bool:
        return any(x is not None for x in (self.ram, self.disk, self.redis))

    def validate(self) -> None:
        """Raise a one-line HafizaError for a bad option, before the model is loaded."""
        check_codec(self.codec)
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


def tiers_header(out: RequestOutput) -> str:
    """The `x-hafiza-tiers` value for a request's first output (ASCII only: HTTP headers are latin-1)."""
    reason = out.external_decision
    decision = reason.split(":", 1)[0] if reason else "none"
    parts = [f"decision={decision}", f"pool={out.num_cached_tokens - out.external_tokens}"]
    parts += [f"{tier}={tokens}" for tier, tokens in out.external_sources.items()]
    parts.append(f"computed={out.num_prompt_tokens - out.num_cached_tokens}")
    if reason:
        parts.append(f"why={reason.translate(_ASCII)}")
    return "; ".join(parts).encode("ascii", "replace").decode()


class TierReports:
    """The header value of recent requests, recorded from the engine thread's step outputs (bounded)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._values: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, outputs: list[RequestOutput]) -> None:
        """A step listener: remember the first output of every request."""
        with self._lock:
            for out in outputs:
                if out.request_id not in self._values:
                    self._values[out.request_id] = tiers_header(out)
                    while len(self._values) > self.capacity:
                        self._values.popitem(last=False)

    def get(self, request_id: str) -> str | None:
        with self._lock:
            return self._values.get(request_id)

    async def wait(self, request_id: str, timeout_s: float = 0.5) -> str | None:
        """The value, waiting briefly: the engine delivers an output just before its listeners run."""
        deadline = time.monotonic() + timeout_s
        while (value := self.get(request_id)) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        return value


class TiersHeaderMiddleware:
    """Pure ASGI middleware (safe for streamed responses): adds `x-hafiza-tiers` to successful responses."""

    def __init__(self, app: Any, reports: TierReports) -> None:
        self.app, self.reports = app, reports

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: dict) -> None:
            if message["type"] == "http.response.start" and message.get("status") == 200:
                headers = list(message.get("headers", []))
                rid = next((v.decode("latin-1") for k, v in headers if k in (b"request-id", b"x-request-id")), None)
                value = await self.reports.wait(rid) if rid else None
                if value is not None:
                    message = {**message, "headers": [*headers, (HEADER.encode(), value.encode("latin-1"))]}
            await send(message)

        await self.app(scope, receive, send_with_header)


class FlushOnShutdown:
    """Pure ASGI middleware: flush pending store writes before the app reports its shutdown complete.

    uvicorn shuts down gracefully on SIGTERM and SIGINT, then re-raises the signal: with SIGTERM the process
    ends there, so the lifespan shutdown is the last point where the writes can be finished."""

    def __init__(self, app: Any, connector: StoreConnector, timeout_s: float = 30.0) -> None:
        self.app, self.connector, self.timeout_s = app, connector, timeout_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def send_after_flush(message: dict) -> None:
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


class ConnectorCollector(Collector):
    """The connector's own counters: saves skipped or dropped, blocks loaded, corrupt blocks, decisions."""

    def __init__(self, connector: StoreConnector) -> None:
        self.connector = connector

    def collect(self) -> Iterator[Metric]:
        s = self.connector.stats
        for name, doc, value in (
            ("store_saves", "Full blocks handed to the store connector.", s.saves),
            ("store_saves_skipped", "Blocks not written: every tier already held them.", s.saves_skipped),
            ("store_saves_dropped", "Blocks not written: the encoder queue was full.", s.saves_dropped),
            ("store_encode_errors", "Blocks the codec failed to encode.", s.encode_errors),
            ("store_lookup_errors", "Admission lookups that failed inside the store (answered as misses).",
             s.lookup_errors),
            ("store_blocks_loaded", "Blocks loaded from the tiers into the pool.", s.blocks_loaded),
            ("store_blocks_corrupt", "Loaded blocks that failed the codec's checks (dropped, recomputed).",
             s.blocks_corrupt),
        ):
            c = CounterMetricFamily(f"hafiza:{name}", doc)
            c.add_metric([], value)
            yield c
        decisions = CounterMetricFamily("hafiza:store_decisions", "Admission lookups by outcome.",
                                        labels=["decision"])
        for decision, count in s.decisions.items():
            decisions.add_metric([decision], count)
        yield decisions
        pending = GaugeMetricFamily("hafiza:store_encode_queue_bytes", "Raw block bytes waiting for the encoder.")
        pending.add_metric([], s.pending_bytes)
        yield pending


def attach_store(aengine: AsyncEngine, app: FastAPI, options: StoreOptions,
                 registry: CollectorRegistry | None = None) -> StoreConnector:
    """Build the tiers, attach a connector to the engine (call before serving requests), export metrics on
    `registry` (default: the app's), add the per-request `x-hafiza-tiers` header and flush pending writes at
    the app's shutdown."""
    options.validate()
    store = build_tiers(options.ram, options.disk, options.redis, write_back=options.write_back)
    ttl = parse_redis_url(options.redis).ttl_s if options.redis else DEFAULT_TTL_S
    connector = StoreConnector.for_engine(aengine.engine, store, codec=options.codec, default_ttl_s=ttl)
    aengine.engine.attach_connector(connector)
    registry = registry or app.state.hafiza.metrics.registry
    register_store_metrics(registry, store)
    registry.register(ConnectorCollector(connector))
    reports = TierReports()
    aengine.step_listeners.append(reports.record)
    app.add_middleware(TiersHeaderMiddleware, reports=reports)
    app.add_middleware(FlushOnShutdown, connector=connector)
    return connector
