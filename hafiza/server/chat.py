"""OpenAI Chat Completions replies: sampling settings from the request, and the n choices as one body or as
SSE chunks (content, `tool_calls` deltas, logprobs, finish, usage)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

from hafiza.engine.grammar import GrammarSpec
from hafiza.engine.sampling import SamplingParams
from hafiza.server.choices import Choice, Choices
from hafiza.server.errors import ApiError
from hafiza.server.generation import Generation
from hafiza.server.logprobs import TokenNames, chat_entry
from hafiza.server.schemas.openai import ChatCompletionRequest, SamplingFields, VllmFields
from hafiza.server.state import ServerState
from hafiza.server.streaming import ClientGone, sse
from hafiza.server.tools.parse import CallPart, TextPart
from hafiza.server.tools.spec import ToolCall

log = logging.getLogger("hafiza.server")
FINISH_REASONS = {"stop": "stop", "stop_sequence": "stop", "length": "length", "abort": "stop"}
Json = dict[str, object]


def logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's `logit_bias` (token id strings) as the engine's {token id: bias}; the engine checks ids and values."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit() and len(key) <= 18):  # int() of unicode or 4,300+ digits raises
            raise ApiError(400, f"logit_bias: {key[:40]!r} is not a token id", param="logit_bias")
        out[int(key)] = float(value)
    return out


def sampling(req: SamplingFields, max_tokens: int, logprobs: int | None,
             grammar: GrammarSpec | None, prompt_logprobs: int | None = None,
             speculative: bool | None = None) -> SamplingParams:
    """Engine settings shared by chat and legacy completions (OpenAI defaults: temperature 1, top_p 1), with
    vLLM's extensions where the body has them (`no_stop_trim` is include_stop_str_in_output) and hafiza's
    `speculative` (false: this request never drafts)."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    ext = req if isinstance(req, VllmFields) else VllmFields()
    return SamplingParams(
        ignore_eos=bool(ext.ignore_eos), min_tokens=ext.min_tokens or 0,
        skip_special_tokens=ext.skip_special_tokens is not False, include_stop_str_in_output=bool(ext.no_stop_trim),
        max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, min_p=req.min_p or 0.0,
        seed=req.seed, stop=stop, n=req.n or 1, logit_bias=logit_bias(req.logit_bias),
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logprobs=logprobs, prompt_logprobs=prompt_logprobs, grammar=grammar, speculative=speculative is not False)


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    """`logprobs: true` with `top_logprobs` alternatives; `top_logprobs` alone is refused, as OpenAI does."""
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def _call_json(call: ToolCall) -> Json:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _finish(choice: Choice) -> str:
    if choice.reader.calls and choice.finish_reason != "length":
        return "tool_calls"
    return FINISH_REASONS.get(choice.finish_reason or "stop", "stop")


def chat_body(gen: Generation, choices: Choices, req: ChatCompletionRequest, created: int, usage: Json,
              state: ServerState) -> Json:
    """The non-streaming `chat.completion` object."""
    names = TokenNames(state.tokenizer)
    top = req.top_logprobs or 0
    out_choices = []
    for c in choices.items:
        message: Json = {"role": "assistant", "content": c.reader.text or (None if c.reader.calls else ""),
                         "refusal": None}
        if c.reader.calls:
            message["tool_calls"] = [_call_json(call) for call in c.reader.calls]
        logprobs = {"content": [chat_entry(names, lp, top) for lp in c.logprobs], "refusal": None} \
            if req.logprobs else None
        out_choices.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": _finish(c)})
    return {"id": gen.request_id, "object": "chat.completion", "created": created, "model": req.model,
            "system_fingerprint": state.fingerprint, "choices": out_choices, "usage": usage}


async def chat_chunks(gen: Generation, choices: Choices, req: ChatCompletionRequest, created: int,
                      usage: Callable[[int], Json], include_usage: bool, state: ServerState) -> AsyncIterator[bytes]:
    """Role chunks, content and `tool_calls` deltas (a call's id and name, then its arguments), a finish chunk
    per choice, the usage chunk if asked for, then [DONE]. `usage(completion_tokens)` builds the usage object."""
    names = TokenNames(state.tokenizer)
    top = req.top_logprobs or 0
    call_index = [0] * len(choices.items)

    def chunk(index: int, delta: Json, finish: str | None = None, logprobs: Json | None = None) -> bytes:
        data: Json = {"id": gen.request_id, "object": "chat.completion.chunk", "created": created,
                      "model": req.model, "system_fingerprint": state.fingerprint,
                      "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            data["usage"] = None
        return sse(data)

    try:
        for c in choices.items:
            yield chunk(c.index, {"role": "assistant", "content": ""})
        out = gen.last
        while True:
            if out is None:
                yield b": keep-alive\n\n"
            else:
                step = choices.feed(out)
                i = step.choice.index
                lps: Json | None = None
                if req.logprobs and out.logprobs:
                    lps = {"content": [chat_entry(names, lp, top) for lp in out.logprobs], "refusal": None}
                for part in step.parts:
                    if isinstance(part, TextPart):
                        yield chunk(i, {"content": part.text}, logprobs=lps)
                    elif isinstance(part, CallPart):
                        k, call = call_index[i], part.call
                        call_index[i] += 1
                        yield chunk(i, {"tool_calls": [{"index": k, "id": call.id, "type": "function",
                                                        "function": {"name": call.name, "arguments": ""}}]},
                                    logprobs=lps)
                        yield chunk(i, {"tool_calls": [{"index": k, "function": {"arguments": call.arguments}}]})
                    lps = None
                if lps is not None:
                    yield chunk(i, {"content": ""}, logprobs=lps)
                if step.choice.finished:
                    yield chunk(i, {}, _finish(step.choice))
            if choices.done:
                break
            out = await gen.next(timeout=state.settings.ping_interval_s)
        if include_usage:
            yield sse({"id": gen.request_id, "object": "chat.completion.chunk", "created": created,
                       "model": req.model, "system_fingerprint": state.fingerprint, "choices": [],
                       "usage": usage(choices.output_tokens)})
        yield sse("[DONE]")
    except ClientGone:
        return
    except ApiError as exc:
        yield sse({"error": {"message": exc.message, "type": "server_error", "param": None, "code": None}})
    except Exception as exc:  # the stream has started: the error can only be a chunk now
        log.exception("stream of %s failed", gen.request_id)
        yield sse({"error": {"message": f"internal server error ({type(exc).__name__})", "type": "server_error",
                             "param": None, "code": None}})
    finally:
        await gen.close()
