"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API with prompt caching."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from hafiza.engine.sampling import SamplingParams
from hafiza.server.auth import request_partition, require_anthropic_key
from hafiza.server.body import check_message_count, parse_json, read_body, validate
from hafiza.server.choices import Choices
from hafiza.server.convert import anthropic_conversation, anthropic_tools
from hafiza.server.generation import Generation, begin
from hafiza.server.messages import content_blocks, message, message_events, stop_reason
from hafiza.server.offload import off_loop
from hafiza.server.prompt import Prompt, build_prompt
from hafiza.server.schemas.anthropic import CountTokensRequest, MessagesRequest
from hafiza.server.state import ServerState, server_state
from hafiza.server.streaming import SSEResponse
from hafiza.server.structured import tool_grammar
from hafiza.server.tools.formats import tool_format
from hafiza.server.tools.reply import ToolUse
from hafiza.server.usage import CacheUsage, anthropic_usage, counted_breakpoints, pins_for

API = "anthropic"
log = logging.getLogger("hafiza.server")
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "stop_sequence": "stop_sequence", "abort": "end_turn"}
FIELDS = {"stop": "stop_sequences"}  # engine field -> this API's, for a 400's param
ID_HEADER = "request-id"

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
    return req, build_prompt(state.tokenizer, anthropic_conversation(req, tool_format(state.tokenizer)),
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
    tools, _, choice = anthropic_tools(req)
    tool_use = ToolUse(tool_format(state.tokenizer), tools, choice)
    params = SamplingParams(max_tokens=req.max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                            top_k=req.top_k or 0, top_p=1.0 if req.top_p is None else req.top_p,
                            stop=list(req.stop_sequences or []), speculative=req.speculative is not False,
                            grammar=tool_grammar(tool_use.tools, tool_use.choice, tool_use.fmt))
    counted = counted_breakpoints(prompt.breakpoints, state.settings.min_cache_tokens)
    gen = Generation(state, API, request, prompt, params, f"msg_{uuid.uuid4().hex[:24]}", pins_for(counted),
                     ignored_breakpoints=len(prompt.breakpoints) - len(counted),
                     cache_salt=request_partition(request, req.cache_salt), fields=FIELDS)
    choices = Choices(1, lambda: tool_use.reader(state.tokenizer))
    started = await begin([(gen, choices)], bool(req.stream))
    if started is None:
        return Response(status_code=499)
    (first,) = started
    usage = anthropic_usage(len(prompt.ids), first.num_cached_tokens, counted, state.block_size)
    state.metrics.record_usage(API, usage)
    if req.stream:
        events = message_events(gen, choices, req.model, req.max_tokens, usage_json(usage, 0), usage_json(usage, 0),
                                state.settings.ping_interval_s, eager_text=not tool_use.reader(state.tokenizer).active)
        return SSEResponse(events, headers=gen.headers(ID_HEADER), on_close=gen.close)
    (choice,) = choices.items
    body = message(gen.request_id, req.model, content_blocks(choice, req.max_tokens),
                   usage_json(usage, choices.output_tokens))
    body["stop_reason"] = stop_reason(choice)
    body["stop_sequence"] = choice.stop_sequence
    return JSONResponse(body, headers=gen.headers(ID_HEADER))
