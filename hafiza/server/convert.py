"""Request bodies to `Conversation`s: the order the APIs cache in (tools, system, messages), with breakpoints.

Text is what the model sees. Tool definitions are rendered as JSON in a leading system turn (they are part of
the cached prefix, so their order matters, as with the real APIs); tool calls and results are rendered as text.
Images and other non-text blocks are refused with a 400 naming the block.
"""

from __future__ import annotations

import json
from typing import Any

from hafiza.server.errors import ApiError
from hafiza.server.prompt import Conversation, Piece, Turn
from hafiza.server.schemas.anthropic import CacheControl, ContentBlock, CountTokensRequest
from hafiza.server.schemas.openai import ChatMessage

MAX_BREAKPOINTS = 4
TOOLS_HEADER = "You can call these tools (JSON definitions):"


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def _ttl(cc: CacheControl | None) -> str | None:
    return cc.ttl if cc is not None else None


def _anthropic_block(block: ContentBlock, where: str) -> Piece:
    """One content block as text."""
    if block.type == "text":
        if block.text is None:
            raise ApiError(400, f"{where}.text: field required", param=f"{where}.text")
        if not block.text:
            raise ApiError(400, f"{where}.text: text content blocks must be non-empty", param=f"{where}.text")
        return Piece(block.text, _ttl(block.cache_control))
    if block.type == "tool_use":
        return Piece(f"[tool_use {block.name} id={block.id}] {_json(block.input or {})}", _ttl(block.cache_control))
    if block.type == "tool_result":
        content = block.content
        if isinstance(content, list):
            content = "\n".join(_anthropic_block(b, f"{where}.content").text for b in content)
        flag = " error" if block.is_error else ""
        return Piece(f"[tool_result{flag} id={block.tool_use_id}] {content or ''}", _ttl(block.cache_control))
    raise ApiError(400, f"{where}.type: {block.type!r} blocks are not supported by this server (text, tool_use and "
                        f"tool_result are)", param=f"{where}.type")


def anthropic_conversation(req: CountTokensRequest) -> Conversation:
    """Tools, system and messages of a Messages request, breakpoints checked (at most 4; 1h before 5m)."""
    if not req.messages:
        raise ApiError(400, "messages: at least one message is required", param="messages")
    turns: list[Turn] = []
    if req.tools:
        tool_pieces = [Piece(_json(t.model_dump(exclude={"cache_control"}, exclude_none=True)), _ttl(t.cache_control))
                       for t in req.tools]
        turns.append(Turn("system", "tools", [Piece(TOOLS_HEADER), *tool_pieces]))
    if isinstance(req.system, str):
        if req.system:
            turns.append(Turn("system", "system", [Piece(req.system)]))
    elif req.system:
        pieces = []
        for j, block in enumerate(req.system):
            if block.type != "text":
                raise ApiError(400, f"system[{j}].type: system blocks must be text, got {block.type!r}",
                               param=f"system[{j}].type")
            pieces.append(_anthropic_block(block, f"system[{j}]"))
        turns.append(Turn("system", "system", pieces))
    last = len(req.messages) - 1
    for i, msg in enumerate(req.messages):
        where = f"messages[{i}]"
        if isinstance(msg.content, str):
            pieces = [Piece(msg.content)]
        else:
            pieces = [_anthropic_block(b, f"{where}.content[{j}]") for j, b in enumerate(msg.content)]
        final_assistant = i == last and msg.role == "assistant"
        if not final_assistant and (not pieces or not any(p.text for p in pieces)):
            raise ApiError(400, f"{where}.content: messages must have non-empty content (only a final assistant "
                                f"message may be empty)", param=f"{where}.content")
        if final_assistant and pieces and pieces[-1].text != pieces[-1].text.rstrip():
            raise ApiError(400, "final assistant content cannot end with trailing whitespace",
                           param=f"{where}.content")
        turns.append(Turn(msg.role, where, pieces or [Piece("")]))
    if req.cache_control is not None and turns[-1].pieces[-1].ttl is None:
        turns[-1].pieces[-1].ttl = req.cache_control.ttl
    check_breakpoints(turns)
    return Conversation(turns, continue_final=req.messages[-1].role == "assistant")


def check_breakpoints(turns: list[Turn]) -> None:
    """The API's limits: at most 4 cache_control blocks, and no 1h breakpoint after a 5m one."""
    ttls = [p.ttl for t in turns for p in t.pieces if p.ttl is not None]
    if len(ttls) > MAX_BREAKPOINTS:
        raise ApiError(400, f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
                            f"Found {len(ttls)}.")
    if "5m" in ttls and "1h" in ttls[ttls.index("5m"):]:
        raise ApiError(400, "A ttl='1h' cache_control block must not come after a ttl='5m' cache_control block. "
                            "Note that blocks are processed in the following order: `tools`, `system`, `messages`.")


def _openai_text(msg: ChatMessage, where: str) -> str:
    if isinstance(msg.content, list):
        texts = []
        for j, part in enumerate(msg.content):
            if part.type != "text" or part.text is None:
                raise ApiError(400, f"{where}.content[{j}]: only text parts are supported by this server, got "
                                    f"{part.type!r}", param=f"{where}.content[{j}]")
            texts.append(part.text)
        text = "\n".join(texts)
    else:
        text = msg.content or ""
    if msg.tool_calls:
        text += "".join(f"\n[tool_call] {_json(call)}" for call in msg.tool_calls)
    if msg.role == "tool":
        text = f"[tool_result id={msg.tool_call_id}] {text}"
    return text


def openai_conversation(messages: list[ChatMessage], tools: list[dict[str, Any]] | None) -> Conversation:
    """Tools then the messages in order; `developer` is a system message. No breakpoints: caching is automatic."""
    if not messages:
        raise ApiError(400, "messages: at least one message is required", param="messages")
    turns: list[Turn] = []
    if tools:
        turns.append(Turn("system", "tools", [Piece(TOOLS_HEADER), *(Piece(_json(t)) for t in tools)]))
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        text = _openai_text(msg, where)
        if msg.role in ("user", "system", "developer") and not text:
            raise ApiError(400, f"{where}.content: {msg.role} messages must have non-empty content",
                           param=f"{where}.content")
        turns.append(Turn("system" if msg.role == "developer" else msg.role, where, [Piece(text)]))
    return Conversation(turns)
