"""Read a request body under a size and time limit, parse JSON and validate it, naming the problem on failure.

Parsed JSON is checked before anything else sees it: nesting at most MAX_JSON_DEPTH levels, no NaN/Infinity, and
no lone UTF-16 surrogate (`"\\ud800"`) in any string, since none of them can be tokenized, echoed or re-encoded.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from hafiza.server.errors import ApiError

M = TypeVar("M", bound=BaseModel)
MAX_JSON_DEPTH = 100
_SURROGATE = re.compile("[\ud800-\udfff]")


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The raw body; 413 as soon as it is known to exceed `limit` bytes (from Content-Length or while reading);
    408 (and the connection closed) if it has not all arrived `timeout_s` seconds after the headers."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {int(declared)} bytes exceeds the limit of {limit} bytes",
                       code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"request body exceeds the limit of {limit} bytes",
                                   code="request_too_large")
                chunks.append(chunk)
    except TimeoutError as exc:
        raise ApiError(408, f"request body not received within {timeout_s:g} s ({size} bytes arrived)",
                       code="request_timeout", headers={"connection": "close"}) from exc
    return b"".join(chunks)


def parse_json(raw: bytes) -> dict[str, Any]:
    """A JSON object, or 400 saying where the JSON is broken."""
    if not raw.strip():
        raise ApiError(400, "request body is empty: expected a JSON object")
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"malformed JSON in request body: {exc.msg} at line {exc.lineno} column {exc.colno}",
                       ) from exc
    except RecursionError as exc:
        raise ApiError(400, f"request body nests JSON deeper than the limit of {MAX_JSON_DEPTH} levels") from exc
    except ValueError as exc:  # an integer of more digits than Python converts (4300)
        raise ApiError(400, f"request body has a number that cannot be read: {exc}") from exc
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}")
    _check_tree(data, raw)
    return data


def _no_constant(name: str) -> float:
    raise ApiError(400, f"malformed JSON in request body: {name} is not a JSON value")


_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


def _check_tree(data: dict[str, Any], raw: bytes) -> None:
    """400 naming the place of the first string with a lone surrogate, or of nesting past MAX_JSON_DEPTH. Strings
    are scanned only if the raw body escapes a surrogate (UTF-8 cannot carry one), so the common case only walks
    the containers."""
    scan = _ESCAPED_SURROGATE.search(raw) is not None
    stack: list[tuple[dict[str, Any] | list[Any], int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            where = loc_text(_path_to(data, value))
            raise ApiError(400, f"{where}: JSON nests deeper than the limit of {MAX_JSON_DEPTH} levels", param=where)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in items:
            if scan and isinstance(key, str) and _SURROGATE.search(key):
                raise ApiError(400, f"{loc_text(_path_to(data, value)) or 'body'}: a key has a lone UTF-16 "
                                    f"surrogate; strings must be valid Unicode")
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
            elif scan and isinstance(child, str) and (bad := _SURROGATE.search(child)) is not None:
                where = loc_text((*_path_to(data, value), key))
                raise ApiError(400, f"{where}: text has a lone UTF-16 surrogate (\\u{ord(bad.group()):04x}) at "
                                    f"character {bad.start()}; strings must be valid Unicode", param=where)


def _path_to(root: dict[str, Any] | list[Any], target: dict[str, Any] | list[Any]) -> tuple[Any, ...]:
    """The location of the container `target` inside `root` (found again, only to word an error)."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(root, ())]
    while stack:
        value, loc = stack.pop()
        if value is target:
            return loc
        items = value.items() if isinstance(value, dict) else enumerate(value)
        stack.extend((child, (*loc, key)) for key, child in items if isinstance(child, dict | list))
    return ()


def check_message_count(data: dict[str, Any], limit: int) -> None:
    """400 if the body has more than `limit` messages (checked before validation, which is costly per message)."""
    messages = data.get("messages")
    if isinstance(messages, list) and len(messages) > limit:
        raise ApiError(400, f"messages: {len(messages)} messages exceed the server's limit of {limit}",
                       param="messages")


def loc_text(loc: tuple[Any, ...]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def validate(model: type[M], data: dict[str, Any]) -> M:
    """Validate strictly (no silent string-to-number coercion); 400 naming the first bad field."""
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        locs = [tuple(p for p in e["loc"] if not _is_union_tag(p)) for e in errors]
        best = max(range(len(errors)), key=lambda i: len(locs[i]))
        first, loc = errors[best], locs[best]
        where = loc_text(loc) or "body"
        detail = first["msg"]
        if first["type"] == "missing":
            detail = "field required"
        others = {x for x in locs if x != loc[: len(x)]}
        more = f" (and {len(others)} more problems)" if others else ""
        raise ApiError(400, f"{where}: {detail}{more}", param=where) from exc


def _is_union_tag(part: Any) -> bool:
    """Pydantic puts the tried union member ('str', 'list[...]', 'function-after[...]') in error locations."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "list", "dict"))
