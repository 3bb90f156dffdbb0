"""Browser safety, as pure ASGI middleware (safe for streamed responses): a Host allow-list against DNS rebinding,
and for state-changing methods a JSON-only body with a same-origin check against cross-site requests.

A page on another origin can make a browser send a "simple" POST (form fields, `text/plain`) without asking the
server first; it can never send `application/json` cross-origin without a CORS preflight, which this server
refuses unless `cors_origins` lists that origin. Browsers also say where a request comes from (`Origin`,
`Sec-Fetch-Site`): anything but this server's own origin (or a listed one) is refused. Clients outside a browser
send neither header and pass.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

from hafiza.server.errors import error_body, flavor_of
from hafiza.server.settings import ServerSettings

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger("hafiza.server")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
SAME_SITE_OK = frozenset({"same-origin", "none"})


def host_name(host: str) -> str:
    """'Example.com:8000' -> 'example.com'; '[::1]:8000' -> '::1' (the port is not part of the check)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    name, sep, port = host.rpartition(":")
    return name.rstrip(".") if sep and port.isdigit() and ":" not in name else host.rstrip(".")


def is_json(content_type: str) -> bool:
    """application/json (any parameters, e.g. charset), or a `+json` type."""
    media = content_type.partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class BrowserGuard:
    """Refuses (in the route's API error shape) what a hostile web page could make a browser send."""

    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.app, self.settings = app, settings
        self.any_host = "*" in settings.allowed_hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        problem = self.check(scope["method"], headers)
        if problem is None:
            await self.app(scope, receive, send)
            return
        status, message, code = problem
        flavor = flavor_of(scope["path"])
        state = getattr(getattr(scope.get("app"), "state", None), "hafiza", None)
        if state is not None:
            state.metrics.errors.labels(flavor.value, str(status)).inc()
        log.info("%s %s refused -> %d: %s", scope["method"], scope["path"], status, message)
        body = json.dumps(error_body(flavor, status, message, code=code)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    def check(self, method: str, headers: dict[str, str]) -> tuple[int, str, str] | None:
        """(status, message, code) of the first rule the request breaks, or None."""
        host = headers.get("host", "")
        if not self.any_host and host_name(host) not in self.settings.allowed_hosts:
            return (400, f"Host {host!r} is not served here (allowed: {', '.join(self.settings.allowed_hosts)}; "
                         "the server's allowed_hosts setting lists them)", "invalid_host")
        if method in SAFE_METHODS:
            return None
        origin = headers.get("origin")
        listed = origin is not None and origin.rstrip("/") in self.settings.cors_origins
        if origin is not None and not listed and urlsplit(origin).netloc.lower() != host.strip().lower():
            return (403, f"cross-origin {method} refused: Origin {origin!r} is not this server ({host}); "
                         "allow it in the server's cors_origins setting", "cross_origin")
        site = headers.get("sec-fetch-site")
        if site is not None and site.lower() not in SAME_SITE_OK and not listed:
            return (403, f"cross-site {method} refused (Sec-Fetch-Site: {site}); allow the page's origin in the "
                         "server's cors_origins setting", "cross_origin")
        content_type = headers.get("content-type", "")
        if not is_json(content_type):
            shown = repr(content_type) if content_type else "none"
            return (415, f"{method} needs 'content-type: application/json', got {shown}", "unsupported_media_type")
        return None
