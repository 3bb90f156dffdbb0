"""POST /v1/chat/completions/render, /v1/completions/render and /v1/responses/render: the token ids the engine
would run for a body, in vLLM's response shape (its GenerateRequest), without running the engine.

vllm-router's `cache_aware` and `kv_aware` policies call these on every worker for every request, so they do only
what the generation route does before it queues the request: parse and validate the body, render the chat
template (tools included) and tokenize, all on a worker thread, then the engine's own admission checks (context
length, sampling values) without compiling any grammar. The ids are the generation route's, computed by the same
code. Chat and responses answer one object; completions one per prompt, in a list, as vLLM does.
"""

from __future__ import annotations

import dataclasses
import uuid

from fastapi import APIRouter, Depends, Request

from hafiza.engine.sampling import SamplingParams
from hafiza.errors import RequestError
from hafiza.server.auth import require_openai_key
from hafiza.server.body import read_body
from hafiza.server.errors import ApiError
from hafiza.server.offload import off_loop
from hafiza.server.routes import completions, openai, responses
from hafiza.server.state import ServerState, server_state

Json = dict[str, object]
router = APIRouter(dependencies=[Depends(require_openai_key)])


def vllm_sampling_params(p: SamplingParams) -> Json:
    """The engine's settings under vLLM's SamplingParams names (`structured_outputs` from the grammar)."""
    structured: Json | None = None
    if p.grammar is not None:
        key = {"json_schema": "json", "regex": "regex", "ebnf": "grammar", "json_object": "json_object"}
        structured = {key.get(p.grammar.kind, p.grammar.kind): p.grammar.text or True}
    return {"n": p.n, "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
            "repetition_penalty": p.repetition_penalty, "temperature": p.temperature, "top_p": p.top_p,
            "top_k": p.top_k, "min_p": p.min_p, "seed": p.seed, "stop": p.stop, "stop_token_ids": p.stop_token_ids,
            "ignore_eos": p.ignore_eos, "max_tokens": p.max_tokens, "min_tokens": p.min_tokens,
            "logprobs": p.logprobs, "prompt_logprobs": p.prompt_logprobs,
            "skip_special_tokens": p.skip_special_tokens,
            "include_stop_str_in_output": p.include_stop_str_in_output,
            "logit_bias": {str(k): v for k, v in p.logit_bias.items()} or None, "structured_outputs": structured}


def generate_request(request_id: str, ids: list[int], params: SamplingParams, model: str, stream: bool,
                     cache_salt: str | None) -> Json:
    """vLLM's GenerateRequest for one prompt; hafiza's `speculative: false` has no field there: refused."""
    if not params.speculative:
        raise ApiError(400, "speculative: a rendered request cannot carry hafiza's speculative opt-out; leave it "
                            "out of the body", param="speculative")
    return {"request_id": request_id, "token_ids": ids, "features": None,
            "sampling_params": vllm_sampling_params(params), "model": model, "stream": stream,
            "stream_options": None, "cache_salt": cache_salt, "priority": 0, "kv_transfer_params": None}


def _admit(state: ServerState, ids: list[int], params: SamplingParams, fields: dict[str, str]) -> None:
    """The engine's admission checks (400 naming this API's field), the grammar's compilation left out."""
    try:
        state.aengine.engine.check_request(ids, dataclasses.replace(params, grammar=None))
    except RequestError as exc:
        param = fields.get(exc.param, exc.param) if exc.param is not None else None
        raise ApiError(400, str(exc), param=param) from exc


def _chat(raw: bytes, state: ServerState) -> Json:
    req, prompt, tool_use = openai._prepare(raw, state)
    params = openai.sampling_params(req, len(prompt.ids), state, tool_use)
    _admit(state, prompt.ids, params, openai.FIELDS)
    return generate_request(f"chatcmpl-{uuid.uuid4().hex[:24]}", prompt.ids, params, req.model, bool(req.stream),
                            req.cache_salt)


def _completions(raw: bytes, state: ServerState) -> list[Json]:
    req, prompts = completions._prepare(raw, state)
    params = completions.sampling_params(req)
    rid = f"cmpl-{uuid.uuid4().hex[:24]}"
    out = []
    for k, prompt in enumerate(prompts):
        _admit(state, prompt.ids, params, {})
        out.append(generate_request(f"{rid}-{k}" if len(prompts) > 1 else rid, prompt.ids, params, req.model,
                                    bool(req.stream), req.cache_salt))
    return out


def _responses(raw: bytes, state: ServerState, previous: responses.Stored | None) -> Json:
    p = responses._prepare(raw, state, previous)
    params = responses.sampling_params(p, state)
    _admit(state, p.prompt.ids, params, responses.FIELDS)
    return generate_request(f"resp_{uuid.uuid4().hex[:24]}", p.prompt.ids, params, p.req.model,
                            bool(p.req.stream), p.req.cache_salt)


@router.post("/v1/chat/completions/render")
async def render_chat(request: Request, state: ServerState = Depends(server_state)) -> Json:
    """The prompt token ids and sampling settings /v1/chat/completions would run for this body."""
    raw = await read_body(request, state.settings.max_body_bytes, state.settings.body_timeout_s)
    return await off_loop(_chat, raw, state)


@router.post("/v1/completions/render")
async def render_completions(request: Request, state: ServerState = Depends(server_state)) -> list[Json]:
    """One GenerateRequest per prompt of this /v1/completions body."""
    raw = await read_body(request, state.settings.max_body_bytes, state.settings.body_timeout_s)
    return await off_loop(_completions, raw, state)


@router.post("/v1/responses/render")
async def render_responses(request: Request, state: ServerState = Depends(server_state)) -> Json:
    """The prompt token ids /v1/responses would run for this body (a previous_response_id's conversation
    included)."""
    raw = await read_body(request, state.settings.max_body_bytes, state.settings.body_timeout_s)
    _, previous = responses.previous_response(request, raw)
    return await off_loop(_responses, raw, state, previous)
