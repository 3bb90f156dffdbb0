"""POST /v1/completions: OpenAI's legacy Completions API (prompt strings or token ids, echo, logprobs), enough
for lm-eval's `local-completions` loglikelihood tasks; caching is the same automatic prefix cache."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from hafiza.engine.results import RequestOutput
from hafiza.engine.sampling import SamplingParams
from hafiza.server.auth import request_partition, require_openai_key
from hafiza.server.body import parse_json, read_body, validate
from hafiza.server.chat import FINISH_REASONS, sampling
from hafiza.server.choices import Choice, Choices
from hafiza.server.errors import ApiError
from hafiza.server.extensions import check_extensions
from hafiza.server.generation import Generation, begin, close_all
from hafiza.server.logprobs import CompletionLogprobs, TokenNames
from hafiza.server.offload import off_loop
from hafiza.server.pd import Handoff
from hafiza.server.prompt import Conversation, Prompt
from hafiza.server.routes.openai import usage_json
from hafiza.server.schemas.completions import CompletionRequest
from hafiza.server.state import ServerState, server_state
from hafiza.server.streaming import ClientGone, SSEResponse, sse
from hafiza.server.tiers import HEADER as TIERS_HEADER
from hafiza.server.tools.formats import GENERIC
from hafiza.server.tools.parse import TextPart
from hafiza.server.tools.reply import ReplyReader
from hafiza.server.tools.spec import ToolChoice
from hafiza.server.usage import CacheUsage, openai_usage

API = "openai"
log = logging.getLogger("hafiza.server")
MAX_PROMPTS = 64
Json = dict[str, object]
router = APIRouter(dependencies=[Depends(require_openai_key)])


class RawPrompt(Prompt):
    """A prompt given as text or token ids: no chat turns, so every token is in the one segment `prompt`."""

    def segment_at(self, token: int) -> str:
        return "end" if token >= len(self.ids) else "prompt"


def raw_prompt(state: ServerState, prompt: str | list[int], where: str) -> RawPrompt:
    """Token ids (range-checked) or text encoded as the model reads it (its BOS added if it wants one)."""
    tok = state.tokenizer
    if isinstance(prompt, str):
        ids, text = tok.encode(prompt), prompt
    else:
        bad = [i for i in prompt if not 0 <= i < tok.vocab_size]
        if bad:
            raise ApiError(400, f"{where}: token id {bad[0]} is outside the vocabulary (0..{tok.vocab_size - 1})",
                           param="prompt")
        ids, text = list(prompt), tok.decode(list(prompt), skip_special=False)
    if not ids:
        raise ApiError(400, f"{where}: the prompt is empty", param="prompt")
    ends = list(range(1, len(ids) + 1))
    return RawPrompt(conversation=Conversation([]), text=text, ids=ids, breakpoints=[], segment_hashes={},
                     token_ends=ends, tokenizer=tok)


def _prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts: one string, one list of ids, or a list of either."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise ApiError(400, "prompt: at least one prompt is required", param="prompt")
    ids = [x for x in p if isinstance(x, int)]
    if len(ids) == len(p):
        return [ids]
    return [x for x in p if isinstance(x, str | list)]


def _prepare(raw: bytes, state: ServerState) -> tuple[CompletionRequest, list[RawPrompt]]:
    req = validate(CompletionRequest, parse_json(raw))
    state.check_model(req.model)
    check_extensions(req, state.tokenizer, state.role)
    if req.suffix:
        raise ApiError(400, "suffix: insertion (fill in the middle) is not supported by this server", param="suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise ApiError(400, f"best_of: only best_of equal to n is supported (got best_of={req.best_of}, "
                            f"n={req.n or 1})", param="best_of")
    prompts = _prompts(req)
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", param="prompt")
    return req, [raw_prompt(state, p, f"prompt[{i}]") for i, p in enumerate(prompts)]


@dataclass
class Run:
    """One prompt's generation and its n choices."""

    prompt: RawPrompt
    gen: Generation
    choices: Choices
    usage: CacheUsage | None = None
    first: RequestOutput | None = None


def sampling_params(req: CompletionRequest) -> SamplingParams:
    """Engine sampling settings: 16 tokens unless max_tokens says otherwise (OpenAI's default), echoed prompt
    tokens' logprobs when echo asks for logprobs."""
    echo_lp = req.logprobs if req.echo and req.logprobs is not None else None
    return sampling(req, req.max_tokens if req.max_tokens is not None else 16, req.logprobs, None, echo_lp,
                    speculative=req.speculative)


@router.post("/v1/completions")
async def completions(request: Request, state: ServerState = Depends(server_state)) -> Response:
    """Complete one or more prompts, streaming (SSE) or not."""
    raw = await read_body(request, state.settings.max_body_bytes, state.settings.body_timeout_s)
    req, prompts = await off_loop(_prepare, raw, state)
    rid = f"cmpl-{uuid.uuid4().hex[:24]}"
    runs: list[Run] = []
    for k, prompt in enumerate(prompts):
        params = sampling_params(req)
        gen = Generation(state, API, request, prompt, params, f"{rid}-{k}" if len(prompts) > 1 else rid,
                         cache_salt=request_partition(request, req.cache_salt))
        reader = lambda: ReplyReader(state.tokenizer, GENERIC, [], ToolChoice("none"))  # noqa: E731
        runs.append(Run(prompt, gen, Choices(params.n, reader)))
    handoff = Handoff.of(state.pd, req.kv_transfer_params, bool(req.stream), [p.ids for p in prompts],
                         request_partition(request, req.cache_salt))
    with handoff.admission():
        firsts = await begin([(r.gen, r.choices) for r in runs], bool(req.stream))
    if firsts is None:
        return Response(status_code=499)
    transfer = await handoff.finish(firsts[0])
    for r, first in zip(runs, firsts, strict=True):
        r.usage, r.first = openai_usage(len(r.prompt.ids), first.num_cached_tokens), first
        state.metrics.record_usage(API, r.usage)
    created = int(time.time())
    headers = handoff.headers({**runs[0].gen.headers("x-request-id"), "x-request-id": rid}, TIERS_HEADER)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def close_runs() -> None:
            await close_all([r.gen for r in runs])

        return SSEResponse(_chunks(runs, req, rid, created, include_usage, state), headers=headers,
                           on_close=close_runs)
    names = TokenNames(state.tokenizer)
    out_choices: list[Json] = []
    for k, r in enumerate(runs):
        for c in r.choices.items:
            text, lps = _choice_text(r, c, req, names)
            out_choices.append({"index": k * len(r.choices.items) + c.index, "text": text,
                                "logprobs": lps.json() if lps else None,
                                "finish_reason": FINISH_REASONS.get(c.finish_reason or "stop", "stop")})
    body: Json = {"id": rid, "object": "text_completion", "created": created, "model": req.model,
                  "system_fingerprint": state.fingerprint, "choices": out_choices, "usage": _usage(runs)}
    if transfer is not None:
        body["kv_transfer_params"] = transfer
    return JSONResponse(body, headers=headers)


def _usage(runs: list[Run]) -> Json:
    total = CacheUsage(sum(r.usage.input_tokens for r in runs if r.usage),
                       sum(r.usage.cache_read for r in runs if r.usage), 0, 0)
    return usage_json(total, sum(r.choices.output_tokens for r in runs))


def _prompt_logprobs(r: Run, req: CompletionRequest, names: TokenNames) -> CompletionLogprobs | None:
    """The echoed prompt's tokens and logprobs (null for the first token)."""
    if req.logprobs is None:
        return None
    lps = CompletionLogprobs(names, req.logprobs)
    if req.echo:
        plps = (r.first.prompt_logprobs if r.first is not None else None) or [None] * len(r.prompt.ids)
        for token_id, lp in zip(r.prompt.ids, plps, strict=False):
            lps.add(token_id, lp)
    return lps


def _choice_text(r: Run, c: Choice, req: CompletionRequest, names: TokenNames
                 ) -> tuple[str, CompletionLogprobs | None]:
    lps = _prompt_logprobs(r, req, names)
    if lps is not None:
        for token_id, lp in zip(c.token_ids, c.logprobs, strict=False):
            lps.add(token_id, lp)
    return (r.prompt.text if req.echo else "") + c.reader.text, lps


async def _chunks(runs: list[Run], req: CompletionRequest, rid: str, created: int, include_usage: bool,
                  state: ServerState) -> AsyncIterator[bytes]:
    """Per prompt in order: text chunks per choice (the echoed prompt first), finish chunks; usage; [DONE]."""
    names = TokenNames(state.tokenizer)

    def chunk(index: int, text: str, logprobs: Json | None, finish: str | None = None) -> bytes:
        data: Json = {"id": rid, "object": "text_completion", "created": created, "model": req.model,
                      "system_fingerprint": state.fingerprint,
                      "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            data["usage"] = None
        return sse(data)

    try:
        for k, r in enumerate(runs):
            n = len(r.choices.items)
            logs = {c.index: _prompt_logprobs(r, req, names) for c in r.choices.items}
            if req.echo:
                for c in r.choices.items:
                    lp = logs[c.index]
                    yield chunk(k * n + c.index, r.prompt.text, lp.json() if lp else None)
            out = r.gen.last
            while True:
                if out is None:
                    yield b": keep-alive\n\n"
                else:
                    step = r.choices.feed(out)
                    c = step.choice
                    lp = logs[c.index]
                    entry: Json | None = None
                    if lp is not None:
                        merged: dict[str, list[object]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                           "text_offset": []}
                        for token_id, tlp in zip(out.new_token_ids, out.logprobs, strict=False):
                            for key, val in lp.add(token_id, tlp).items():
                                merged[key] += val
                        entry = dict(merged)
                    text = "".join(p.text for p in step.parts if isinstance(p, TextPart))
                    if text or entry:
                        yield chunk(k * n + c.index, text, entry)
                    if c.finished:
                        yield chunk(k * n + c.index, "", None, FINISH_REASONS.get(c.finish_reason or "stop", "stop"))
                if r.choices.done:
                    break
                out = await r.gen.next(timeout=state.settings.ping_interval_s)
        if include_usage:
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": req.model,
                       "system_fingerprint": state.fingerprint, "choices": [], "usage": _usage(runs)})
        yield sse("[DONE]")
    except ClientGone:
        return
    except ApiError as exc:
        yield sse({"error": {"message": exc.message, "type": "server_error", "param": None, "code": None}})
    except Exception as exc:  # the stream has started: the error can only be a chunk now
        log.exception("stream of %s failed", rid)
        yield sse({"error": {"message": f"internal server error ({type(exc).__name__})", "type": "server_error",
                             "param": None, "code": None}})
