"""POST /v1/chat/completions: the OpenAI Chat Completions API with automatic prefix caching."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from hafiza.engine.sampling import SamplingParams
from hafiza.server.auth import request_partition, require_openai_key
from hafiza.server.body import check_message_count, parse_json, read_body, validate
from hafiza.server.convert import openai_conversation
from hafiza.server.errors import ApiError
from hafiza.server.generation import Generation, run_to_end, start_stream
from hafiza.server.offload import off_loop
from hafiza.server.prompt import Prompt, build_prompt
from hafiza.server.schemas.openai import ChatCompletionRequest
from hafiza.server.state import ServerState, server_state
from hafiza.server.streaming import ClientGone, SSEResponse, sse
from hafiza.server.usage import CacheUsage, openai_usage

API = "openai"
FINISH_REASONS = {"stop": "stop", "stop_sequence": "stop", "length": "length", "abort": "stop"}

router = APIRouter(dependencies=[Depends(require_openai_key)])


def usage_json(usage: CacheUsage, completion_tokens: int) -> dict[str, Any]:
    """`prompt_tokens` includes the cached ones; `prompt_tokens_details.cached_tokens` is always present."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": usage.prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cache_read, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                      "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0},
    }


def sampling_params(req: ChatCompletionRequest, prompt_len: int, max_model_len: int) -> SamplingParams:
    """Engine sampling settings; without a token limit the reply may use the rest of the context."""
    if req.n not in (None, 1):
        raise ApiError(400, f"n: only n=1 is supported, got {req.n}", param="n")
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if limit is None:
        limit = max(0, max_model_len - prompt_len)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return SamplingParams(max_tokens=limit, temperature=1.0 if req.temperature is None else req.temperature,
                          top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed, stop=stop)


def _prepare(raw: bytes, state: ServerState) -> tuple[ChatCompletionRequest, Prompt]:
    """Body bytes to the validated request and its prompt (CPU work: runs on a worker thread)."""
    body = parse_json(raw)
    check_message_count(body, state.settings.max_messages)
    req = validate(ChatCompletionRequest, body)
    state.check_model(req.model)
    return req, build_prompt(state.tokenizer, openai_conversation(req.messages, req.tools),
                             state.settings.allow_special_tokens_in_content, state.settings.max_prompt_chars)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, state: ServerState = Depends(server_state)) -> Response:
    """Create a chat completion, streaming (SSE) or not."""
    raw = await read_body(request, state.settings.max_body_bytes, state.settings.body_timeout_s)
    req, prompt = await off_loop(_prepare, raw, state)
    params = sampling_params(req, len(prompt.ids), state.max_model_len)
    state.check_request(prompt.ids, params)
    gen = Generation(state, API, request, prompt, params, f"chatcmpl-{uuid.uuid4().hex[:24]}",
                     cache_salt=request_partition(request, req.cache_salt))
    try:
        if req.stream:
            first = await start_stream(gen)
        else:
            await run_to_end(gen)
    except ClientGone:
        return Response(status_code=499)
    created = int(time.time())
    if req.stream:
        usage = openai_usage(len(prompt.ids), first.num_cached_tokens)
        state.metrics.record_usage(API, usage)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return SSEResponse(_chunks(gen, req.model, created, usage, include_usage, state), headers=_headers(gen),
                           on_close=gen.close)
    assert gen.last is not None
    usage = openai_usage(len(prompt.ids), gen.last.num_cached_tokens)
    state.metrics.record_usage(API, usage)
    body_out = {
        "id": gen.request_id, "object": "chat.completion", "created": created, "model": req.model,
        "system_fingerprint": state.fingerprint,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(gen.text), "refusal": None},
                     "logprobs": None, "finish_reason": FINISH_REASONS.get(gen.last.finish_reason or "stop")}],
        "usage": usage_json(usage, gen.output_tokens),
    }
    return JSONResponse(body_out, headers=_headers(gen))


def _headers(gen: Generation) -> dict[str, str]:
    assert gen.explanation is not None
    return {"x-hafiza-cache": gen.explanation.header(), "x-request-id": gen.request_id}


async def _chunks(gen: Generation, model: str, created: int, usage: CacheUsage, include_usage: bool,
                  state: ServerState) -> AsyncIterator[bytes]:
    """Role chunk, content chunks, a finish chunk, the usage chunk if asked for, then [DONE]."""

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        data: dict[str, Any] = {"id": gen.request_id, "object": "chat.completion.chunk", "created": created,
                                "model": model, "system_fingerprint": state.fingerprint,
                                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if include_usage:
            data["usage"] = None
        return sse(data)

    try:
        yield chunk({"role": "assistant", "content": ""})
        out = gen.last
        while True:
            if out is not None and out.text:
                yield chunk({"content": out.text})
            if gen.finished:
                break
            out = await gen.next(timeout=state.settings.ping_interval_s)
            if out is None:
                yield b": keep-alive\n\n"
        last = gen.last
        yield chunk({}, FINISH_REASONS.get(last.finish_reason or "stop"))
        if include_usage:
            yield sse({"id": gen.request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                       "system_fingerprint": state.fingerprint, "choices": [],
                       "usage": usage_json(usage, gen.output_tokens)})
        yield sse("[DONE]")
    except ClientGone:
        return
    except ApiError as exc:
        yield sse({"error": {"message": exc.message, "type": "server_error", "param": None, "code": None}})
    finally:
        await gen.close()
