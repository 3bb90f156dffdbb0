"""POST /v1/chat/completions: the OpenAI Chat Completions API with automatic prefix caching."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from hafiza.engine.sampling import SamplingParams
from hafiza.server.auth import request_partition, require_openai_key
from hafiza.server.body import check_message_count, parse_json, read_body, validate
from hafiza.server.chat import chat_body, chat_chunks, chat_logprobs, sampling
from hafiza.server.choices import Choices
from hafiza.server.convert import openai_conversation, openai_tools
from hafiza.server.errors import ApiError
from hafiza.server.extensions import check_extensions
from hafiza.server.generation import Generation, begin
from hafiza.server.offload import off_loop
from hafiza.server.pd import Handoff
from hafiza.server.prompt import Prompt, build_prompt
from hafiza.server.schemas.openai import ChatCompletionRequest
from hafiza.server.state import ServerState, server_state
from hafiza.server.streaming import SSEResponse
from hafiza.server.structured import pick_grammar, response_format_grammar, tool_grammar
from hafiza.server.tiers import HEADER as TIERS_HEADER
from hafiza.server.tools.formats import tool_format
from hafiza.server.tools.reply import ToolUse
from hafiza.server.usage import CacheUsage, openai_usage

API = "openai"
log = logging.getLogger("hafiza.server")
FINISH_REASONS = {"stop": "stop", "stop_sequence": "stop", "length": "length", "abort": "stop"}
FIELDS = {"logprobs": "top_logprobs"}  # engine field -> this API's, for a 400's param
ID_HEADER = "x-request-id"

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


def sampling_params(req: ChatCompletionRequest, prompt_len: int, state: ServerState, tool_use: ToolUse
                    ) -> SamplingParams:
    """Engine sampling settings; without a token limit the reply may use the rest of the context. A forced tool
    choice or a response_format becomes the grammar the reply must match."""
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if limit is None:
        limit = max(0, state.max_model_len - prompt_len)
    if req.store:
        raise ApiError(400, "store: stored completions are not supported by this server", param="store")
    grammar = pick_grammar(tool_grammar(tool_use.tools, tool_use.choice, tool_use.fmt),
                           response_format_grammar(req.response_format))
    return sampling(req, limit, chat_logprobs(req), grammar, speculative=req.speculative)


def _prepare(raw: bytes, state: ServerState) -> tuple[ChatCompletionRequest, Prompt, ToolUse]:
    """Body bytes to the validated request and its prompt (CPU work: runs on a worker thread)."""
    body = parse_json(raw)
    check_message_count(body, state.settings.max_messages)
    req = validate(ChatCompletionRequest, body)
    state.check_model(req.model)
    check_extensions(req, state.tokenizer, state.role)
    tools, choice = openai_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    tool_use = ToolUse(tool_format(state.tokenizer), tools, choice)
    conv = openai_conversation(req.messages, tools, tool_use.fmt, choice, bool(req.continue_final_message))
    return req, build_prompt(state.tokenizer, conv, state.settings.allow_special_tokens_in_content,
                             state.settings.max_prompt_chars), tool_use


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, state: ServerState = Depends(server_state)) -> Response:
    """Create a chat completion, streaming (SSE) or not."""
    raw = await read_body(request, state.settings.max_body_bytes, state.settings.body_timeout_s)
    req, prompt, tool_use = await off_loop(_prepare, raw, state)
    params = sampling_params(req, len(prompt.ids), state, tool_use)
    salt = request_partition(request, req.cache_salt)
    gen = Generation(state, API, request, prompt, params, f"chatcmpl-{uuid.uuid4().hex[:24]}",
                     cache_salt=salt, fields=FIELDS)
    choices = Choices(params.n, lambda: tool_use.reader(state.tokenizer))
    handoff = Handoff.of(state.pd, req.kv_transfer_params, bool(req.stream), [prompt.ids], salt)
    with handoff.admission():
        started = await begin([(gen, choices)], bool(req.stream))
    if started is None:
        return Response(status_code=499)
    (first,) = started
    transfer = await handoff.finish(first)
    headers = handoff.headers(gen.headers(ID_HEADER), TIERS_HEADER)
    created = int(time.time())
    usage = openai_usage(len(prompt.ids), first.num_cached_tokens)
    state.metrics.record_usage(API, usage)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return SSEResponse(chat_chunks(gen, choices, req, created, lambda n: usage_json(usage, n), include_usage,
                                       state), headers=headers, on_close=gen.close)
    body_out = chat_body(gen, choices, req, created, usage_json(usage, choices.output_tokens), state)
    if transfer is not None:
        body_out["kv_transfer_params"] = transfer
    return JSONResponse(body_out, headers=headers)
