"""API errors in each API's own shape (Anthropic or OpenAI), and the handlers that turn any failure into one."""

from __future__ import annotations

import logging
import math
from enum import StrEnum
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("hafiza.server")


class Flavor(StrEnum):
    """Which API a route speaks, and so which error shape it answers with."""

    ANTHROPIC = "anthropic"
    OPENAI = "openai"


ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
                   413: "request_too_large",
                   415: "invalid_request_error", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                   529: "overloaded_error"}
OPENAI_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
                429: "rate_limit_error", 500: "server_error",
                503: "server_error"}


class ApiError(Exception):
    """A failure to report to the client: HTTP status, one line naming the problem, OpenAI's param/code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def status_for(self, flavor: Flavor) -> int:
        """The HTTP status in `flavor`'s API (the same for both, except overload)."""
        return self.status


class OverloadedError(ApiError):
    """The server is too busy to queue the request: 429 on OpenAI routes, 529 `overloaded_error` on Anthropic
    routes, both with `retry-after` (whole seconds)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        seconds = max(1, math.ceil(retry_after_s))
        super().__init__(429, message, code="overloaded", headers={"retry-after": str(seconds)})

    def status_for(self, flavor: Flavor) -> int:
        return 529 if flavor is Flavor.ANTHROPIC else 429


def flavor_of(path: str) -> Flavor:
    """Anthropic routes live under /v1/messages; everything else answers in OpenAI's shape."""
    return Flavor.ANTHROPIC if path.startswith("/v1/messages") else Flavor.OPENAI


def error_body(flavor: Flavor, status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The JSON body each API uses for an error."""
    if flavor is Flavor.ANTHROPIC:
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    return {"error": {"message": message, "type": OPENAI_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(flavor: Flavor, err: ApiError) -> JSONResponse:
    status = err.status_for(flavor)
    return JSONResponse(error_body(flavor, status, err.message, err.param, err.code), status_code=status,
                        headers=err.headers)


def _answer(request: Request, err: ApiError) -> JSONResponse:
    """The error response, counted on the app's metrics (if it has them) and logged as one line."""
    flavor = flavor_of(request.url.path)
    state = getattr(request.app.state, "hafiza", None)
    if state is not None:
        state.metrics.errors.labels(flavor.value, str(err.status_for(flavor))).inc()
    log.info("%s %s -> %d: %s", request.method, request.url.path, err.status_for(flavor), err.message)
    return error_response(flavor, err)


class CatchAllMiddleware:
    """Answers any exception a route lets through with a 500 in the route's API shape, and never lets it reach
    the ASGI server (uvicorn closes the connection on one, so a keep-alive client's next request would fail).
    A response already started is ended cleanly instead."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = complete = False

        async def tracked(message: Message) -> None:
            nonlocal started, complete
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            request = Request(scope)
            log.exception("internal error on %s %s", request.method, request.url.path)
            if not started:
                await _answer(request, ApiError(500, f"internal server error ({type(exc).__name__})"))(
                    scope, receive, send)
            elif not complete:
                try:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except Exception:  # the client is gone: nothing left to tell it
                    log.debug("could not end the response to %s", request.url.path)


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as JSON in the route's API shape; internal failures are logged, never shown. The app
    adds CatchAllMiddleware last, so that it wraps every other middleware too."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _answer(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail) if exc.detail else "error"
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        code = "not_found" if exc.status_code == 404 else None
        response = _answer(request, ApiError(exc.status_code, message, code=code))
        if exc.headers:  # a 405 names the allowed methods in `Allow`
            response.headers.update(exc.headers)
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _answer(request, ApiError(400, f"invalid request: {exc.errors()[:1]}"))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return _answer(request, ApiError(500, f"internal server error ({type(exc).__name__})"))
