"""The KV store seen from the HTTP app: its metrics on /metrics, its tiers for the dashboard, and its pending
writes flushed when the app shuts down. The connector is attached to the engine before the engine thread starts
(`hafiza.cli.store.connect_store`); this module only exposes it."""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import FastAPI
from prometheus_client.registry import CollectorRegistry
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hafiza.server.state import ServerState
from hafiza.server.store_metrics import ConnectorCollector, register_store_metrics
from hafiza.store.connector import StoreConnector

log = logging.getLogger("hafiza.store")


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
