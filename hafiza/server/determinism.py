"""The `x-hafiza-deterministic` response header on every /v1/ response: "true" when greedy output does not depend
on cache state or batch-mates, else "false; reason=..." (hafiza/engine/determinism.py, docs/ENGINE.md)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-hafiza-deterministic"


class DeterminismHeader:
    """ASGI middleware adding HEADER (a fixed value, from the engine's configuration) to /v1/ responses."""

    def __init__(self, app: ASGIApp, value: str) -> None:
        self.app, self.value = app, value.encode("latin-1")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return

        async def with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (HEADER.encode(), self.value)]
            await send(message)

        await self.app(scope, receive, with_header)
