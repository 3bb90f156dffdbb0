"""Anthropic Messages replies: content blocks (text, `tool_use`) as one body or as SSE events
(`content_block_start` / `text_delta` / `input_json_delta` / `content_block_stop`), and the stop reason."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from hafiza.server.choices import Choice, Choices
from hafiza.server.errors import ApiError
from hafiza.server.generation import Generation
from hafiza.server.streaming import ClientGone, sse
from hafiza.server.tools.parse import CallPart, TextPart
from hafiza.server.tools.spec import ToolCall

log = logging.getLogger("hafiza.server")
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "stop_sequence": "stop_sequence", "abort": "end_turn"}
Json = dict[str, object]


def tool_use_block(call: ToolCall) -> Json:
    """A `tool_use` block; ids in Anthropic's `toolu_` form."""
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": call.input}


def stop_reason(choice: Choice) -> str:
    if choice.reader.calls and choice.finish_reason != "length":
        return "tool_use"
    return STOP_REASONS.get(choice.finish_reason or "stop", "end_turn")


def content_blocks(choice: Choice, max_tokens: int) -> list[Json]:
    """The reply's text (one block, omitted when empty beside calls) and its calls."""
    blocks: list[Json] = []
    if choice.reader.text or (not choice.reader.calls and max_tokens):
        blocks.append({"type": "text", "text": choice.reader.text})
    return blocks + [tool_use_block(c) for c in choice.reader.calls]


def message(rid: str, model: str, content: list[Json], usage: Json) -> Json:
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": None, "stop_sequence": None, "usage": usage}


async def message_events(gen: Generation, choices: Choices, model: str, max_tokens: int, start_usage: Json,
                         final_usage: Json, ping_interval_s: float, eager_text: bool) -> AsyncIterator[bytes]:
    """message_start (final input usage), content blocks as they come, ping, message_delta (cumulative usage
    with the output tokens filled in), message_stop. `eager_text`: open the text block at once (no tools)."""
    try:
        yield sse({"type": "message_start", "message": message(gen.request_id, model, [], start_usage)},
                  "message_start")
        index = -1
        open_kind: str | None = None
        if eager_text and max_tokens > 0:
            index, open_kind = 0, "text"
            yield sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                      "content_block_start")
        yield sse({"type": "ping"}, "ping")
        out = gen.last
        while True:
            if out is None:
                yield sse({"type": "ping"}, "ping")
            else:
                step = choices.feed(out)
                for part in step.parts:
                    if isinstance(part, TextPart):
                        if open_kind != "text":
                            index, open_kind = index + 1, "text"
                            yield sse({"type": "content_block_start", "index": index,
                                       "content_block": {"type": "text", "text": ""}}, "content_block_start")
                        yield sse({"type": "content_block_delta", "index": index,
                                   "delta": {"type": "text_delta", "text": part.text}}, "content_block_delta")
                    elif isinstance(part, CallPart):
                        if open_kind is not None:
                            yield sse({"type": "content_block_stop", "index": index}, "content_block_stop")
                        index, open_kind = index + 1, "tool_use"
                        block = {**tool_use_block(part.call), "input": {}}
                        yield sse({"type": "content_block_start", "index": index, "content_block": block},
                                  "content_block_start")
                        yield sse({"type": "content_block_delta", "index": index,
                                   "delta": {"type": "input_json_delta",
                                             "partial_json": json.dumps(part.call.input, ensure_ascii=False)}},
                                  "content_block_delta")
                        yield sse({"type": "content_block_stop", "index": index}, "content_block_stop")
                        open_kind = None
            if choices.done:
                break
            out = await gen.next(timeout=ping_interval_s)
        if open_kind is not None:
            yield sse({"type": "content_block_stop", "index": index}, "content_block_stop")
        (choice,) = choices.items
        yield sse({"type": "message_delta",
                   "delta": {"stop_reason": stop_reason(choice), "stop_sequence": choice.stop_sequence},
                   "usage": {**final_usage, "output_tokens": choices.output_tokens}}, "message_delta")
        yield sse({"type": "message_stop"}, "message_stop")
    except ClientGone:
        return
    except ApiError as exc:
        yield sse({"type": "error", "error": {"type": "api_error", "message": exc.message}}, "error")
    except Exception as exc:  # the stream has started: the error can only be an event now
        log.exception("stream of %s failed", gen.request_id)
        yield sse({"type": "error", "error": {"type": "api_error",
                                              "message": f"internal server error ({type(exc).__name__})"}}, "error")
    finally:
        await gen.close()
