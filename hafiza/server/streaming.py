"""Bridging one engine request to one HTTP exchange: its output stream, disconnect watching, SSE.

Readers wait on the engine's per-request stream with timeouts (for SSE pings) and can stop at any moment:
closing the stream aborts the engine request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from hafiza.engine.async_engine import RequestStream
from hafiza.engine.results import RequestOutput


class ClientGone(Exception):
    """The HTTP client disconnected; the request is being aborted."""


class DisconnectWatch:
    """Listens for the client going away (after the body has been read) and sets `gone`."""

    def __init__(self, request: Request) -> None:
        self.gone = asyncio.Event()
        self._receive = request.receive
        self._task = asyncio.create_task(self._listen())

    async def _listen(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.gone.set()
                return

    def stop(self) -> None:
        self._task.cancel()


class OutputStream:
    """One engine request's outputs as the HTTP side reads them: the engine's own per-request stream, raced
    against the client going away. Exceptions from the engine are re-raised to the reader."""

    def __init__(self, stream: RequestStream, watch: DisconnectWatch) -> None:
        self.stream, self.watch = stream, watch

    @property
    def done(self) -> bool:
        return self.stream.finished

    async def next(self, timeout: float | None = None) -> RequestOutput | None:
        """The next output; None if `timeout` passed first; ClientGone if the client left."""
        getter = asyncio.ensure_future(self.stream.get())
        gone = asyncio.ensure_future(self.watch.gone.wait())
        try:
            await asyncio.wait({getter, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not getter.done():
                getter.cancel()
        if getter.done() and not getter.cancelled():
            return getter.result()
        if self.watch.gone.is_set():
            raise ClientGone()
        return None

    async def close(self) -> None:
        """Stop the engine request if it is still running (frees its blocks) and stop watching the client."""
        self.watch.stop()
        self.stream.close()


def sse(data: Mapping[str, Any] | str, event: str | None = None) -> bytes:
    """One server-sent event; dicts are sent as compact JSON."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


class SSEResponse(Response):
    """A text/event-stream response that always closes its body iterator and runs `on_close`, even when the
    client is gone before the first byte (an unstarted generator's own `finally` would never run)."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], headers: Mapping[str, str] | None = None,
                 on_close: Callable[[], Awaitable[None]] | None = None) -> None:
        self.body_iterator = body
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            if self.on_close is not None:
                await self.on_close()
