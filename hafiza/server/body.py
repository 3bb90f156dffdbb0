"""Read a request body under a size limit, parse JSON and validate it, naming the problem on failure."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from hafiza.server.errors import ApiError

M = TypeVar("M", bound=BaseModel)


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body; 413 as soon as it is known to exceed `limit` bytes (from Content-Length or while reading)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {int(declared)} bytes exceeds the limit of {limit} bytes",
                       code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(raw: bytes) -> dict[str, Any]:
    """A JSON object, or 400 saying where the JSON is broken."""
    if not raw.strip():
        raise ApiError(400, "request body is empty: expected a JSON object")
    try:
        data = json.loads(raw)
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"malformed JSON in request body: {exc.msg} at line {exc.lineno} column {exc.colno}",
                       ) from exc
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}")
    return data


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
