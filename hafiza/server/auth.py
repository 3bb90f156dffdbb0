"""API-key checks: `x-api-key` for Anthropic routes, `Authorization: Bearer` for OpenAI routes.

Anthropic routes also take `Authorization: Bearer <key>`: the official `anthropic` client (2.x) sends its API key
that way.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from hafiza.server.errors import ApiError


def _matches(given: str | None, key: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), key.encode())


def _bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def require_anthropic_key(request: Request) -> None:
    """401 in Anthropic's shape unless `x-api-key` (or a Bearer token) matches (when the server has a key)."""
    key = request.app.state.hafiza.settings.api_key
    if key is None:
        return
    given, bearer = request.headers.get("x-api-key"), _bearer(request)
    if _matches(given, key) or _matches(bearer, key):
        return
    if given is None and bearer is None:
        raise ApiError(401, "missing x-api-key header")
    raise ApiError(401, "invalid x-api-key")


def require_openai_key(request: Request) -> None:
    """401 in OpenAI's shape unless `Authorization: Bearer <key>` matches (when the server has a key)."""
    key = request.app.state.hafiza.settings.api_key
    if key is None:
        return
    given = _bearer(request)
    if given is None:
        raise ApiError(401, "You didn't provide an API key: send 'Authorization: Bearer <key>'.", code=None)
    if not _matches(given, key):
        raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")


def require_any_key(request: Request) -> None:
    """Shared routes (/v1/models) accept either header."""
    key = request.app.state.hafiza.settings.api_key
    if key is None:
        return
    if not (_matches(request.headers.get("x-api-key"), key) or _matches(_bearer(request), key)):
        raise ApiError(401, "missing or invalid API key: send x-api-key or 'Authorization: Bearer <key>'",
                       code="invalid_api_key")
