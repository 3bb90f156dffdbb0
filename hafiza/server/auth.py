"""Who is calling: API keys (`x-api-key` on Anthropic routes, `Authorization: Bearer` on OpenAI routes), the
admin key, and the cache partition each key owns.

Anthropic routes also take `Authorization: Bearer <key>`: the official `anthropic` client (2.x) sends its API key
that way. Roles: an API key may use the APIs (and, by default, read the dashboard's counts); only the admin key may
act on the dashboard and read cached prompt text. A server with no key at all is open: every caller is admin.
With two or more API keys each key is its own cache partition (a hash of the key, see `key_partition`).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import IntEnum

from fastapi import Request

from hafiza.cache.hashing import key_partition, partition
from hafiza.server.errors import ApiError
from hafiza.server.settings import Access, ServerSettings


class Role(IntEnum):
    """What a caller may do; each role includes the ones below it."""

    ANONYMOUS = 0
    API = 1
    ADMIN = 2


@dataclass(frozen=True)
class Caller:
    """The resolved caller: its role and the cache partition of its key (None: the shared partition)."""

    role: Role
    partition: str | None = None


ANONYMOUS = Caller(Role.ANONYMOUS)


def _matches(given: str | None, key: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode("utf-8", "surrogatepass"),
                                                     key.encode("utf-8", "surrogatepass"))


def _bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _settings(request: Request) -> ServerSettings:
    return request.app.state.hafiza.settings


def resolve(settings: ServerSettings, given: Iterable[str | None]) -> Caller | None:
    """The caller presenting `given` keys: None when a key was presented and none matched. Every configured key
    is compared (in constant time each), so the time taken does not depend on which key matched."""
    if settings.is_open:
        return Caller(Role.ADMIN)
    presented = [g for g in given if g is not None]
    admin = api = None
    for g in presented:
        if settings.admin_key is not None and _matches(g, settings.admin_key):
            admin = g
        for k in settings.keys:
            if _matches(g, k):
                api = k
    own = admin or api
    partition = key_partition(own) if own is not None and settings.partition_by_key else None
    if admin is not None:
        return Caller(Role.ADMIN, partition)
    if api is not None:
        return Caller(Role.API, partition)
    if not settings.keys:
        return Caller(Role.API)  # the APIs are open; a wrong admin key earns nothing more
    return None if presented else ANONYMOUS


def _remember(request: Request, who: Caller) -> Caller:
    request.state.caller = who
    return who


def caller(request: Request) -> Caller:
    """The caller a route's key dependency resolved (the shared partition if none ran)."""
    return getattr(request.state, "caller", ANONYMOUS)


def require_anthropic_key(request: Request) -> None:
    """401 in Anthropic's shape unless `x-api-key` (or a Bearer token) is an API or admin key (when the server
    has API keys)."""
    given, bearer = request.headers.get("x-api-key"), _bearer(request)
    who = resolve(_settings(request), (given, bearer))
    if who is None:
        raise ApiError(401, "invalid x-api-key")
    if who.role < Role.API:
        raise ApiError(401, "missing x-api-key header")
    _remember(request, who)


def require_openai_key(request: Request) -> None:
    """401 in OpenAI's shape unless `Authorization: Bearer <key>` is an API or admin key (when the server has
    API keys)."""
    given = _bearer(request)
    who = resolve(_settings(request), (given,))
    if who is None:
        raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
    if who.role < Role.API:
        raise ApiError(401, "You didn't provide an API key: send 'Authorization: Bearer <key>'.", code=None)
    _remember(request, who)


def _any(request: Request) -> Caller | None:
    return resolve(_settings(request), (request.headers.get("x-api-key"), _bearer(request)))


def require_any_key(request: Request) -> None:
    """Shared routes (/v1/models) accept either header."""
    who = _any(request)
    if who is None or who.role < Role.API:
        raise ApiError(401, "missing or invalid API key: send x-api-key or 'Authorization: Bearer <key>'",
                       code="invalid_api_key")
    _remember(request, who)


def require_admin(request: Request) -> None:
    """Dashboard actions: 401 without a valid key, 403 for an API key (or when no admin key is configured)."""
    who = _any(request)
    if who is not None and who.role >= Role.ADMIN:
        _remember(request, who)
        return
    settings = _settings(request)
    if settings.admin_key is None:
        raise ApiError(403, "this action needs the admin key, and the server has none: start it with an admin key",
                       code="permission_denied")
    if who is not None and who.role == Role.API and settings.keys:
        raise ApiError(403, "an API key cannot do this: it needs the admin key",
                       code="permission_denied")
    raise ApiError(401, "missing or invalid admin key: send x-api-key or 'Authorization: Bearer <key>'",
                   code="invalid_api_key")


def require_access(level_of: Callable[[ServerSettings], Access]) -> Callable[[Request], None]:
    """A dependency for a read-only endpoint whose protection is configurable (`metrics_auth`,
    `dashboard_auth`); it records the caller, so the route can still tell an admin from the rest."""

    def check(request: Request) -> None:
        level = level_of(_settings(request))
        if level is Access.ADMIN:
            require_admin(request)
        elif level is Access.API:
            require_any_key(request)
        else:
            _remember(request, _any(request) or ANONYMOUS)

    return check


def request_partition(request: Request, cache_salt: str | None) -> str | None:
    """The cache partition of one request: its key's partition combined with its body's `cache_salt`."""
    return partition(caller(request).partition, cache_salt)
