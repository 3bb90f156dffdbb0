"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API with prompt caching."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from hafiza.engine.sampling import SamplingParams
from hafiza.server.auth import request_partition, require_anthropic_key
from hafiza.server.body import check_message_count, parse_json, read_body, validate
from hafiza.server.convert import anthropic_conversation
from hafiza.server.errors import ApiError
from hafiza.server.generation import Generation, run_to_end, start_stream
from hafiza.server.offload import off_loop
from hafiza.server.prompt import Prompt, build_prompt
from hafiza.server.schemas.anthropic import CountTokensRequest, MessagesRequest
from hafiza.server.state import ServerState, server_state
from hafiza.server.streaming import ClientGone, SSEResponse, sse
from hafiza.server.usage import CacheUsage, anthropic_usage, counted_breakpoints, pins_for

API = "anthropic"
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "stop_sequence": "stop_sequence", "abort": "end_turn"}

router = APIRouter(dependencies=[Depends(require_anthropic_key)])


def usage_json(usage: CacheUsage, output_tokens: int) -> dict[str, Any]:
    """The `usage` object: the three input fields sum to the prompt length."""
    return {
        "input_tokens": usage.input_tokens,
        "cache_creation_input_tokens": usage.cache_write,
        "cache_read_input_tokens": usage.cache_read,
        "cache_creation": {"ephemeral_5m_input_tokens": usage.write_5m, "ephemeral_1h_input_tokens": usage.write_1h},
        "output_tokens": output_tokens,
        "service_tier": "standard",
    }


async def _prompt(request: Request, state: ServerState, model: type[CountTokensRequest]
                  ) -> tuple[Any, Prompt]:
    raw = await read_body(request, state.settings.max_body_bytes, state.settings.body_timeout_s)
    return await off_loop(_prepare, raw, state, model)


def _prepare(raw: bytes, state: ServerState, model: type[CountTokensRequest]) -> tuple[Any, Prompt]:
    """Body bytes to the validated request and its prompt (CPU work: runs on a worker thread)."""
    body = parse_json(raw)
    check_message_count(body, state.settings.max_messages)
    req = validate(model, body)
    state.check_model(req.model)
    return req, build_prompt(state.tokenizer, anthropic_conversation(req),
                             state.settings.allow_special_tokens_in_content, state.settings.max_prompt_chars)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request, state: ServerState = Depends(server_state)) -> dict[str, int]:
    """Prompt length in tokens, exactly as /v1/messages would see it."""
    _, prompt = await _prompt(request, state, CountTokensRequest)
    return {"input_tokens": len(prompt.ids)}


@router.post("/v1/messages")
async def messages(request: Request, state: ServerState = Depends(server_state)) -> Response:
    """Create a message, streaming (SSE) or not; usage reports cache reads and writes."""
    req, prompt = await _prompt(request, state, MessagesRequest)
    params = SamplingParams(max_tokens=req.max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                            top_k=req.top_k or 0, top_p=1.0 if req.top_p is None else req.top_p,
                            stop=list(req.stop_sequences or []))
    state.check_request(prompt.ids, params)
    counted = counted_breakpoints(prompt.breakpoints, state.settings.min_cache_tokens)
    gen = Generation(state, API, request, prompt, params, f"msg_{uuid.uuid4().hex[:24]}", pins_for(counted),
                     ignored_breakpoints=len(prompt.breakpoints) - len(counted),
                     cache_salt=request_partition(request, req.cache_salt))
    try:
        if req.stream:
            first = await start_stream(gen)
        else:
            await run_to_end(gen)
    except ClientGone:
        return Response(status_code=499)
    if req.stream:
        usage = anthropic_usage(len(prompt.ids), first.num_cached_tokens, counted, state.block_size)
        state.metrics.record_usage(API, usage)
        return SSEResponse(_events(gen, req, usage, state), headers=_headers(gen), on_close=gen.close)
    assert gen.last is not None
    usage = anthropic_usage(len(prompt.ids), gen.last.num_cached_tokens, counted, state.block_size)
    state.metrics.record_usage(API, usage)
    text = "".join(gen.text)
    body = _message(gen.request_id, req.model, [{"type": "text", "text": text}] if req.max_tokens else [],
                    usage_json(usage, gen.output_tokens))
    body["stop_reason"] = STOP_REASONS.get(gen.last.finish_reason or "stop", "end_turn")
    body["stop_sequence"] = gen.last.stop_sequence
    return JSONResponse(body, headers=_headers(gen))


def _headers(gen: Generation) -> dict[str, str]:
    assert gen.explanation is not None
    return {"x-hafiza-cache": gen.explanation.header(), "request-id": gen.request_id}


def _message(rid: str, model: str, content: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": None, "stop_sequence": None, "usage": usage}


async def _events(gen: Generation, req: MessagesRequest, usage: CacheUsage, state: ServerState
                  ) -> AsyncIterator[bytes]:
    """message_start (final input usage), the text block, ping, message_delta (cumulative usage), message_stop."""
    try:
        first = gen.last
        assert first is not None
        yield sse({"type": "message_start",
                   "message": _message(gen.request_id, req.model, [], usage_json(usage, 0))}, "message_start")
        block = req.max_tokens > 0
        if block:
            yield sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                      "content_block_start")
        yield sse({"type": "ping"}, "ping")
        out = first
        while True:
            if out is None:
                yield sse({"type": "ping"}, "ping")
            elif out.text:
                yield sse({"type": "content_block_delta", "index": 0,
                           "delta": {"type": "text_delta", "text": out.text}}, "content_block_delta")
            if gen.finished:
                break
            out = await gen.next(timeout=state.settings.ping_interval_s)
        if block:
            yield sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
        last = gen.last
        yield sse({"type": "message_delta",
                   "delta": {"stop_reason": STOP_REASONS.get(last.finish_reason or "stop", "end_turn"),
                             "stop_sequence": last.stop_sequence},
                   "usage": usage_json(usage, gen.output_tokens)}, "message_delta")
        yield sse({"type": "message_stop"}, "message_stop")
    except ClientGone:
        return
    except ApiError as exc:
        yield sse({"type": "error", "error": {"type": "api_error", "message": exc.message}}, "error")
    finally:
        await gen.close()
