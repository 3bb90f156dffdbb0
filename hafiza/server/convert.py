"""Request bodies to `Conversation`s: the order the APIs cache in (tools, system, messages), with breakpoints.

Text is what the model sees. Tools reach the model through its own chat template where the template renders
them (`tools=`), otherwise through a documented generic system turn (hafiza/server/tools/formats.py); either way
they come before the messages and are part of the cached prefix. Earlier tool calls and results are given to the
template as structured messages (`tool_calls`, role `tool`) or, for the generic format, written in it.
Images and other non-text blocks are refused with a 400 naming the block.
"""

from __future__ import annotations

import hashlib
import json

from hafiza.server.errors import ApiError
from hafiza.server.prompt import Conversation, Piece, Turn
from hafiza.server.schemas.anthropic import CacheControl, ContentBlock, CountTokensRequest
from hafiza.server.schemas.openai import ChatMessage, ChatTool, NamedToolChoice
from hafiza.server.tools.formats import GENERIC, GENERIC_HEADER, ToolFormat
from hafiza.server.tools.spec import ChoiceMode, ToolChoice, ToolDef, check_tools

MAX_BREAKPOINTS = 4
TOOLS_HEADER = GENERIC_HEADER


def _json(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def _ttl(cc: CacheControl | None) -> str | None:
    return cc.ttl if cc is not None else None


def _tool_key(tool: ToolDef) -> str:
    return hashlib.blake2b(_json(tool.openai_form()).encode(), digest_size=8).hexdigest()


def _tool_call_message(call_id: str, name: str, arguments: dict[str, object]) -> dict[str, object]:
    """A history call as chat templates (and Hugging Face) expect it: arguments as an object."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def with_tools(conv: Conversation, tools: list[ToolDef], ttls: list[str | None], fmt: ToolFormat,
               choice: ToolChoice) -> Conversation:
    """Put the tools ahead of the messages (native template or generic system turn) and, for a forced choice,
    start the reply with the family's call prefix (the grammar then forces the call itself)."""
    if not tools:
        return conv
    conv.tool_keys = [_tool_key(t) for t in tools]
    if fmt.native:
        conv.tools = [t.openai_form() for t in tools]
        conv.tool_ttls = ttls
        conv.template_vars = fmt.template_vars()
    else:
        pieces = [Piece(GENERIC_HEADER),
                  *(Piece(_json({"name": t.name, "description": t.description, "parameters": t.parameters}), ttl)
                    for t, ttl in zip(tools, ttls, strict=True))]
        conv.turns.insert(0, Turn("system", "tools", pieces))
    if choice.forced:
        if conv.continue_final:
            raise ApiError(400, "tool_choice: a forced tool call cannot continue a final assistant message (prefill)",
                           param="tool_choice")
        conv.generation_prefix = fmt.call_prefix
    return conv


# -- Anthropic -----------------------------------------------------------------------------------------------

def anthropic_tools(req: CountTokensRequest) -> tuple[list[ToolDef], list[str | None], ToolChoice]:
    """The request's client tools, their breakpoints, and its tool_choice (400 for server tools)."""
    tools: list[ToolDef] = []
    ttls: list[str | None] = []
    for i, t in enumerate(req.tools or []):
        if t.type not in (None, "custom"):
            raise ApiError(400, f"tools[{i}].type: server tools ({t.type!r}) are not supported by this server; "
                                f"define a client tool with name, description and input_schema",
                           param=f"tools[{i}].type")
        tools.append(ToolDef(t.name, t.description, t.input_schema or {"type": "object"}))
        ttls.append(_ttl(t.cache_control))
    tc = req.tool_choice
    if tc is None:
        choice = ToolChoice()
    elif tc.type == "tool":
        if not tc.name:
            raise ApiError(400, "tool_choice.name: field required for type 'tool'", param="tool_choice.name")
        choice = ToolChoice("named", tc.name, not tc.disable_parallel_tool_use)
    else:
        modes: dict[str, ChoiceMode] = {"auto": "auto", "any": "required", "none": "none"}
        choice = ToolChoice(modes[tc.type], None, not tc.disable_parallel_tool_use)
    check_tools(tools, choice, "tools")
    return tools, ttls, choice


def _anthropic_text(block: ContentBlock, where: str) -> str:
    if block.text is None:
        raise ApiError(400, f"{where}.text: field required", param=f"{where}.text")
    if not block.text:
        raise ApiError(400, f"{where}.text: text content blocks must be non-empty", param=f"{where}.text")
    return block.text


def _result_text(block: ContentBlock, where: str) -> str:
    content = block.content
    if isinstance(content, list):
        texts = []
        for j, b in enumerate(content):
            if b.type != "text":
                raise ApiError(400, f"{where}.content[{j}].type: tool results may hold text blocks only, got "
                                    f"{b.type!r}", param=f"{where}.content[{j}].type")
            texts.append(_anthropic_text(b, f"{where}.content[{j}]"))
        content = "\n".join(texts)
    text = content or ""
    return f"Error: {text}" if block.is_error else text


def _anthropic_message(role: str, blocks: list[ContentBlock], where: str, fmt: ToolFormat) -> list[Turn]:
    """One message as template turns: text pieces; tool_use as the turn's calls; tool_result as `tool` turns."""
    turns: list[Turn] = []
    pieces: list[Piece] = []
    calls: list[dict[str, object]] = []
    call_ttl: str | None = None
    for j, block in enumerate(blocks):
        at, ttl = f"{where}.content[{j}]", _ttl(block.cache_control)
        if block.type == "text":
            pieces.append(Piece(_anthropic_text(block, at), ttl))
        elif block.type == "tool_use":
            if role != "assistant":
                raise ApiError(400, f"{at}: tool_use blocks belong in assistant messages", param=at)
            if not block.name or block.id is None:
                raise ApiError(400, f"{at}: tool_use blocks need an id and a name", param=at)
            if fmt.native:
                calls.append(_tool_call_message(block.id, block.name, dict(block.input or {})))
                call_ttl = call_ttl or ttl
            else:
                pieces.append(Piece(fmt.call_text(block.name, _json(block.input or {})), ttl))
        elif block.type == "tool_result":
            if role != "user":
                raise ApiError(400, f"{at}: tool_result blocks belong in user messages", param=at)
            text = _result_text(block, at)
            if fmt.native:
                turns.append(Turn("tool", where, [Piece(text, ttl)], {"tool_call_id": block.tool_use_id or ""}))
            else:
                pieces.append(Piece(f"<tool_response>\n{text}\n</tool_response>", ttl))
        else:
            raise ApiError(400, f"{at}.type: {block.type!r} blocks are not supported by this server (text, "
                                f"tool_use and tool_result are)", param=f"{at}.type")
    if pieces or calls or not turns:
        extra: dict[str, object] | None = {"tool_calls": calls} if calls else None
        pieces = pieces or [Piece("")]
        if call_ttl is not None and pieces[-1].ttl is None:  # a breakpoint on a call covers the whole turn
            pieces[-1].ttl = call_ttl
        turns.append(Turn(role, where, pieces, extra))
    return turns


def anthropic_conversation(req: CountTokensRequest, fmt: ToolFormat = GENERIC) -> Conversation:
    """Tools, system and messages of a Messages request, breakpoints checked (at most 4; 1h before 5m)."""
    if not req.messages:
        raise ApiError(400, "messages: at least one message is required", param="messages")
    tools, ttls, choice = anthropic_tools(req)
    turns: list[Turn] = []
    if isinstance(req.system, str):
        if req.system:
            turns.append(Turn("system", "system", [Piece(req.system)]))
    elif req.system:
        pieces = []
        for j, block in enumerate(req.system):
            if block.type != "text":
                raise ApiError(400, f"system[{j}].type: system blocks must be text, got {block.type!r}",
                               param=f"system[{j}].type")
            pieces.append(Piece(_anthropic_text(block, f"system[{j}]"), _ttl(block.cache_control)))
        turns.append(Turn("system", "system", pieces))
    last = len(req.messages) - 1
    for i, msg in enumerate(req.messages):
        where = f"messages[{i}]"
        if isinstance(msg.content, str):
            msg_turns = [Turn(msg.role, where, [Piece(msg.content)])]
        else:
            msg_turns = _anthropic_message(msg.role, msg.content, where, fmt)
        final_assistant = i == last and msg.role == "assistant"
        empty = all(not t.text and not t.extra and t.role != "tool" for t in msg_turns)
        if not final_assistant and empty:
            raise ApiError(400, f"{where}.content: messages must have non-empty content (only a final assistant "
                                f"message may be empty)", param=f"{where}.content")
        tail = msg_turns[-1].pieces[-1].text
        if final_assistant and tail != tail.rstrip():
            raise ApiError(400, "final assistant content cannot end with trailing whitespace",
                           param=f"{where}.content")
        turns += msg_turns
    if req.cache_control is not None and turns[-1].pieces[-1].ttl is None:
        turns[-1].pieces[-1].ttl = req.cache_control.ttl
    conv = Conversation(turns, continue_final=req.messages[-1].role == "assistant")
    conv = with_tools(conv, tools, ttls, fmt, choice)
    check_breakpoints(conv)
    return conv


def check_breakpoints(conv: Conversation | list[Turn]) -> None:
    """The API's limits: at most 4 cache_control blocks, and no 1h breakpoint after a 5m one (tools first)."""
    turns = conv.turns if isinstance(conv, Conversation) else conv
    tool_ttls = conv.tool_ttls if isinstance(conv, Conversation) else []
    ttls = [t for t in tool_ttls if t is not None] + [p.ttl for t in turns for p in t.pieces if p.ttl is not None]
    if len(ttls) > MAX_BREAKPOINTS:
        raise ApiError(400, f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
                            f"Found {len(ttls)}.")
    if "5m" in ttls and "1h" in ttls[ttls.index("5m"):]:
        raise ApiError(400, "A ttl='1h' cache_control block must not come after a ttl='5m' cache_control block. "
                            "Note that blocks are processed in the following order: `tools`, `system`, `messages`.")


# -- OpenAI --------------------------------------------------------------------------------------------------

def openai_tools(tools: list[ChatTool] | None, tool_choice: object, parallel: bool | None) -> tuple[
        list[ToolDef], ToolChoice]:
    """The function tools and the tool_choice of a chat request (`auto` by default with tools, as OpenAI)."""
    defs = [ToolDef(t.function.name, t.function.description, t.function.parameters or {"type": "object"})
            for t in tools or []]
    if isinstance(tool_choice, NamedToolChoice):
        choice = ToolChoice("named", tool_choice.function.name, parallel is not False)
    elif tool_choice == "none" or tool_choice == "required":
        choice = ToolChoice(tool_choice, None, parallel is not False)
    else:
        choice = ToolChoice("auto" if defs else "none", None, parallel is not False)
    check_tools(defs, choice, "tools")
    return defs, choice


def _openai_text(msg: ChatMessage, where: str) -> str:
    if isinstance(msg.content, list):
        texts = []
        for j, part in enumerate(msg.content):
            if part.type != "text" or part.text is None:
                raise ApiError(400, f"{where}.content[{j}]: only text parts are supported by this server, got "
                                    f"{part.type!r}", param=f"{where}.content[{j}]")
            texts.append(part.text)
        return "\n".join(texts)
    return msg.content or ""


def _openai_turn(msg: ChatMessage, where: str, fmt: ToolFormat) -> Turn:
    text = _openai_text(msg, where)
    if msg.role == "tool":
        if fmt.native:
            return Turn("tool", where, [Piece(text)], {"tool_call_id": msg.tool_call_id or ""})
        return Turn("user", where, [Piece(f"<tool_response>\n{text}\n</tool_response>")])
    if msg.role == "assistant" and msg.tool_calls:
        calls = []
        for j, call in enumerate(msg.tool_calls):
            try:
                args = json.loads(call.function.arguments or "{}")
            except json.JSONDecodeError as exc:
                raise ApiError(400, f"{where}.tool_calls[{j}].function.arguments: not valid JSON ({exc.msg})",
                               param=f"{where}.tool_calls[{j}].function.arguments") from exc
            if not isinstance(args, dict):
                raise ApiError(400, f"{where}.tool_calls[{j}].function.arguments: must be a JSON object",
                               param=f"{where}.tool_calls[{j}].function.arguments")
            calls.append((call.id, call.function.name, args))
        if fmt.native:
            return Turn("assistant", where, [Piece(text)],
                        {"tool_calls": [_tool_call_message(i, n, a) for i, n, a in calls]})
        written = [fmt.call_text(n, _json(a)) for _, n, a in calls]
        return Turn("assistant", where, [Piece("\n".join([text, *written]) if text else "\n".join(written))])
    return Turn("system" if msg.role == "developer" else msg.role, where, [Piece(text)])


def openai_conversation(messages: list[ChatMessage], tools: list[ToolDef] | None = None,
                        fmt: ToolFormat = GENERIC, choice: ToolChoice | None = None,
                        continue_final: bool = False) -> Conversation:
    """Tools then the messages in order; `developer` is a system message. No breakpoints: caching is automatic.
    `continue_final` (vLLM's continue_final_message): the reply continues the final assistant message, which the
    template leaves open, with no generation prompt after it."""
    if not messages:
        raise ApiError(400, "messages: at least one message is required", param="messages")
    if continue_final and messages[-1].role != "assistant":
        raise ApiError(400, f"continue_final_message: the last message must be an assistant message to continue, "
                            f"got role {messages[-1].role!r}", param="continue_final_message")
    if continue_final and messages[-1].tool_calls:
        raise ApiError(400, "continue_final_message: an assistant message with tool_calls cannot be continued",
                       param="continue_final_message")
    turns: list[Turn] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        turn = _openai_turn(msg, where, fmt)
        if msg.role in ("user", "system", "developer") and not turn.text:
            raise ApiError(400, f"{where}.content: {msg.role} messages must have non-empty content",
                           param=f"{where}.content")
        turns.append(turn)
    tools = tools or []
    return with_tools(Conversation(turns, continue_final), tools, [None] * len(tools), fmt, choice or ToolChoice())
