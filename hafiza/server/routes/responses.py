"""POST /v1/responses (and GET /v1/responses/{id}): the OpenAI Responses API, as openai-agents uses it by default.

Text and function tools, streaming events, structured output (`text.format`), and `previous_response_id`: the
server keeps each stored response's conversation (its input items and output items) in memory, per cache
partition, and renders the next turn as that conversation plus the new input, so the earlier turn's KV is
already in the prefix cache and only the new tokens are computed (`usage.input_tokens_details.cached_tokens`).
`instructions` are not carried over from the previous response, as in OpenAI's API.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from hafiza.engine.sampling import SamplingParams
from hafiza.server.auth import request_partition, require_openai_key
from hafiza.server.body import parse_json, read_body, validate
from hafiza.server.chat import sampling
from hafiza.server.choices import Choice, Choices
from hafiza.server.convert import openai_conversation
from hafiza.server.errors import ApiError
from hafiza.server.generation import Generation, begin
from hafiza.server.logprobs import TokenNames, chat_entry
from hafiza.server.offload import off_loop
from hafiza.server.prompt import Prompt, build_prompt
from hafiza.server.schemas.openai import (
    ChatMessage,
    FunctionCall,
    JsonSchemaFormat,
    MessageToolCall,
    ResponseFormat,
    SamplingFields,
)
from hafiza.server.schemas.responses import (
    FunctionCallItem,
    InputItem,
    InputText,
    MessageItem,
    ResponseRequest,
)
from hafiza.server.state import ServerState, server_state
from hafiza.server.streaming import ClientGone, SSEResponse, sse
from hafiza.server.structured import pick_grammar, response_format_grammar, tool_grammar
from hafiza.server.tools.formats import tool_format
from hafiza.server.tools.parse import CallPart, TextPart
from hafiza.server.tools.reply import ToolUse
from hafiza.server.tools.spec import ToolChoice, ToolDef, check_tools
from hafiza.server.usage import CacheUsage, openai_usage

API = "openai"
FIELDS = {"max_tokens": "max_output_tokens", "logprobs": "top_logprobs"}  # engine field -> this API's
log = logging.getLogger("hafiza.server")
STORE_CAPACITY = 1024
Json = dict[str, object]
router = APIRouter(dependencies=[Depends(require_openai_key)])


@dataclass
class Stored:
    """A stored response: the conversation up to and including its output, and the response object."""

    items: list[InputItem]
    response: Json


class ResponseStore:
    """The last STORE_CAPACITY stored responses, keyed by (cache partition, id): another key never sees them."""

    def __init__(self, capacity: int = STORE_CAPACITY) -> None:
        self.capacity = capacity
        self._items: OrderedDict[tuple[str | None, str], Stored] = OrderedDict()

    def get(self, partition: str | None, rid: str) -> Stored | None:
        found = self._items.get((partition, rid))
        if found is not None:
            self._items.move_to_end((partition, rid))
        return found

    def put(self, partition: str | None, rid: str, stored: Stored) -> None:
        self._items[(partition, rid)] = stored
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)


def response_store(request: Request) -> ResponseStore:
    """The app's store (made with the app, create_app)."""
    return request.app.state.hafiza_responses


def _text(content: str | list[InputText]) -> str:
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


def chat_messages(instructions: str | None, items: list[InputItem]) -> list[ChatMessage]:
    """Items as chat messages: function calls join the assistant message before them; outputs are tool turns."""
    out: list[ChatMessage] = [ChatMessage(role="system", content=instructions)] if instructions else []
    for item in items:
        if isinstance(item, MessageItem):
            out.append(ChatMessage(role=item.role, content=_text(item.content)))
        elif isinstance(item, FunctionCallItem):
            call = MessageToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        else:
            out.append(ChatMessage(role="tool", content=_text(item.output), tool_call_id=item.call_id))
    return out


def _tool_use(req: ResponseRequest, state: ServerState) -> ToolUse:
    tools = [ToolDef(t.name, t.description, t.parameters or {"type": "object"}) for t in req.tools or []]
    tc, parallel = req.tool_choice, req.parallel_tool_calls is not False
    if tc is None or tc == "auto":
        choice = ToolChoice("auto" if tools else "none", None, parallel)
    elif tc == "none" or tc == "required":
        choice = ToolChoice(tc, None, parallel)
    else:
        choice = ToolChoice("named", tc.name, parallel)
    check_tools(tools, choice, "tools")
    return ToolUse(tool_format(state.tokenizer), tools, choice)


def _format(req: ResponseRequest) -> ResponseFormat | None:
    fmt = req.text.format if req.text else None
    if fmt is None or fmt.type != "json_schema":
        return ResponseFormat(type=fmt.type) if fmt else None
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name=fmt.name or "response", description=fmt.description, schema=fmt.schema_, strict=fmt.strict))


@dataclass
class Prepared:
    req: ResponseRequest
    history: list[InputItem]
    prompt: Prompt
    tool_use: ToolUse


def _prepare(raw: bytes, state: ServerState, previous: Stored | None) -> Prepared:
    req = validate(ResponseRequest, parse_json(raw))
    state.check_model(req.model)
    new: list[InputItem] = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) \
        else list(req.input)
    history = [*(previous.items if previous else []), *new]
    tool_use = _tool_use(req, state)
    conv = openai_conversation(chat_messages(req.instructions, history), tool_use.tools, tool_use.fmt,
                               tool_use.choice)
    prompt = build_prompt(state.tokenizer, conv, state.settings.allow_special_tokens_in_content,
                          state.settings.max_prompt_chars)
    return Prepared(req, history, prompt, tool_use)


def _usage(usage: CacheUsage, output_tokens: int) -> Json:
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cache_read},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + output_tokens}


def _previous_id(raw: bytes) -> str | None:
    """`previous_response_id` read before validation (the stored conversation is needed to build the prompt)."""
    try:
        value = json.loads(raw).get("previous_response_id")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def previous_response(request: Request, raw: bytes) -> tuple[str | None, Stored | None]:
    """The body's `previous_response_id` and its stored response (in the caller's partition); 400 if none."""
    store = response_store(request)
    prev_id = _previous_id(raw)
    if prev_id is None:
        return None, None
    try:
        body_salt = json.loads(raw).get("cache_salt")
    except ValueError:
        body_salt = None
    previous = store.get(request_partition(request, body_salt if isinstance(body_salt, str) else None), prev_id)
    if previous is None:
        raise ApiError(400, f"previous_response_id: no stored response with id {prev_id!r}",
                       param="previous_response_id", code="previous_response_not_found")
    return prev_id, previous


def sampling_params(p: Prepared, state: ServerState) -> SamplingParams:
    """Engine settings of a prepared request: without max_output_tokens the reply may use the rest of the
    context; tools and text.format become its grammar."""
    req = p.req
    limit = req.max_output_tokens if req.max_output_tokens is not None else max(0, state.max_model_len -
                                                                                  len(p.prompt.ids))
    grammar = pick_grammar(tool_grammar(p.tool_use.tools, p.tool_use.choice, p.tool_use.fmt),
                           response_format_grammar(_format(req), "text.format"))
    fields = SamplingFields(temperature=req.temperature, top_p=req.top_p)
    return sampling(fields, limit, _logprobs(req), grammar, speculative=req.speculative)


def _logprobs(req: ResponseRequest) -> int | None:
    return req.top_logprobs if req.include and "message.output_text.logprobs" in req.include else None


@router.post("/v1/responses")
async def create_response(request: Request, state: ServerState = Depends(server_state)) -> Response:
    """Create a model response, streaming (SSE events) or not."""
    raw = await read_body(request, state.settings.max_body_bytes, state.settings.body_timeout_s)
    store = response_store(request)
    prev_id, previous = previous_response(request, raw)
    p = await off_loop(_prepare, raw, state, previous)
    req = p.req
    params = sampling_params(p, state)
    logprobs = params.logprobs
    partition = request_partition(request, req.cache_salt)
    gen = Generation(state, API, request, p.prompt, params, f"resp_{uuid.uuid4().hex[:24]}", cache_salt=partition,
                     fields=FIELDS)
    choices = Choices(1, lambda: p.tool_use.reader(state.tokenizer))
    started = await begin([(gen, choices)], bool(req.stream))
    if started is None:
        return Response(status_code=499)
    (first,) = started
    usage = openai_usage(len(p.prompt.ids), first.num_cached_tokens)
    state.metrics.record_usage(API, usage)
    shell = _shell(gen.request_id, req, prev_id)
    headers = gen.headers("x-request-id")
    names = TokenNames(state.tokenizer)

    def finish(choice: Choice, output: list[Json]) -> Json:
        done = {**shell, "status": "completed", "output": output, "usage": _usage(usage, choice.output_tokens)}
        if choice.finish_reason == "length":
            done["status"], done["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        if req.store is not False:
            store.put(partition, gen.request_id, Stored([*p.history, *_as_items(output)], done))
        return done

    if req.stream:
        return SSEResponse(_events(gen, choices, shell, finish, names, logprobs, state), headers=headers,
                           on_close=gen.close)
    (choice,) = choices.items
    return JSONResponse(finish(choice, _output(choice, names, logprobs)), headers=headers)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> Json:
    """A stored response of the caller's partition (404 otherwise)."""
    found = response_store(request).get(request_partition(request, None), response_id)
    if found is None:
        raise ApiError(404, f"no stored response with id {response_id!r}", code="not_found")
    return found.response


def _shell(rid: str, req: ResponseRequest, prev_id: str | None) -> Json:
    """The response object's fixed fields (status and output are filled in later)."""
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format \
        else {"type": "text"}
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "model": req.model, "output": [], "instructions": req.instructions, "previous_response_id": prev_id,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "tool_choice": req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump")
            else (req.tool_choice or "auto"),
            "parallel_tool_calls": req.parallel_tool_calls is not False, "temperature": req.temperature,
            "top_p": req.top_p, "max_output_tokens": req.max_output_tokens, "text": {"format": fmt},
            "truncation": "disabled", "store": req.store is not False, "metadata": req.metadata or {},
            "reasoning": {"effort": None, "summary": None}, "error": None, "incomplete_details": None,
            "usage": None, "user": req.user}


def _message_item(item_id: str, text: str, status: str, logprobs: list[Json]) -> Json:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> Json:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _output(choice: Choice, names: TokenNames, logprobs: int | None) -> list[Json]:
    out: list[Json] = []
    if choice.reader.text or not choice.reader.calls:
        lps = [chat_entry(names, lp, logprobs or 0) for lp in choice.logprobs] if logprobs is not None else []
        out.append(_message_item(f"msg_{uuid.uuid4().hex[:24]}", choice.reader.text, "completed", lps))
    for call in choice.reader.calls:
        out.append(_call_item(f"fc_{uuid.uuid4().hex[:24]}", call.id, call.name, call.arguments, "completed"))
    return out


def _as_items(output: list[Json]) -> list[InputItem]:
    """Output items as input items of the next turn."""
    items: list[InputItem] = []
    for o in output:
        if o["type"] == "message":
            parts = o["content"]
            assert isinstance(parts, list)
            items.append(MessageItem(role="assistant", content="".join(str(c["text"]) for c in parts)))
        else:
            items.append(FunctionCallItem(type="function_call", call_id=str(o["call_id"]), name=str(o["name"]),
                                          arguments=str(o["arguments"])))
    return items


async def _events(gen: Generation, choices: Choices, shell: Json, finish: Callable[[Choice, list[Json]], Json],
                  names: TokenNames,
                  logprobs: int | None, state: ServerState) -> AsyncIterator[bytes]:
    """response.created / in_progress, then per output item: added, its deltas, done; then response.completed."""
    seq = 0

    def event(kind: str, **data: object) -> bytes:
        nonlocal seq
        payload = {"type": kind, "sequence_number": seq, **data}
        seq += 1
        return sse(payload, kind)

    output: list[Json] = []
    msg: Json | None = None
    text = ""
    try:
        yield event("response.created", response=shell)
        yield event("response.in_progress", response=shell)
        out = gen.last
        while True:
            if out is None:
                yield b": keep-alive\n\n"
            else:
                step = choices.feed(out)
                lps = [chat_entry(names, lp, logprobs or 0) for lp in out.logprobs] if logprobs is not None else []
                for part in step.parts:
                    if isinstance(part, TextPart):
                        if msg is None:
                            msg = _message_item(f"msg_{uuid.uuid4().hex[:24]}", "", "in_progress", [])
                            msg["content"] = []
                            yield event("response.output_item.added", output_index=len(output), item=msg)
                            yield event("response.content_part.added", item_id=msg["id"], output_index=len(output),
                                        content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                               "logprobs": []})
                        text += part.text
                        yield event("response.output_text.delta", item_id=msg["id"], output_index=len(output),
                                    content_index=0, delta=part.text, logprobs=lps)
                        lps = []
                    elif isinstance(part, CallPart):
                        for chunk in _close_message(msg, text, output, event):
                            yield chunk
                        msg, text = None, ""
                        call = part.call
                        item = _call_item(f"fc_{uuid.uuid4().hex[:24]}", call.id, call.name, "", "in_progress")
                        index = len(output)
                        yield event("response.output_item.added", output_index=index, item=item)
                        yield event("response.function_call_arguments.delta", item_id=item["id"],
                                    output_index=index, delta=call.arguments)
                        yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                    name=call.name, arguments=call.arguments)
                        item = {**item, "arguments": call.arguments, "status": "completed"}
                        output.append(item)
                        yield event("response.output_item.done", output_index=index, item=item)
            if choices.done:
                break
            out = await gen.next(timeout=state.settings.ping_interval_s)
        (choice,) = choices.items
        if msg is None and not output:
            msg = _message_item(f"msg_{uuid.uuid4().hex[:24]}", "", "in_progress", [])
            msg["content"] = []
            yield event("response.output_item.added", output_index=0, item=msg)
            yield event("response.content_part.added", item_id=msg["id"], output_index=0, content_index=0,
                        part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        for chunk in _close_message(msg, text, output, event):
            yield chunk
        done = finish(choice, output)
        yield event("response.completed" if done["status"] == "completed" else "response.incomplete", response=done)
    except ClientGone:
        return
    except ApiError as exc:
        yield event("error", code="server_error", message=exc.message, param=None)
    except Exception as exc:  # the stream has started: the error can only be an event now
        log.exception("stream of %s failed", gen.request_id)
        yield event("error", code="server_error", message=f"internal server error ({type(exc).__name__})", param=None)
    finally:
        await gen.close()


def _close_message(msg: Json | None, text: str, output: list[Json], event: Callable[..., bytes]) -> list[bytes]:
    """The done events of an open message item (appended to `output`)."""
    if msg is None:
        return []
    index = len(output)
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    item = _message_item(str(msg["id"]), text, "completed", [])
    output.append(item)
    return [event("response.output_text.done", item_id=msg["id"], output_index=index, content_index=0, text=text,
                  logprobs=[]),
            event("response.content_part.done", item_id=msg["id"], output_index=index, content_index=0, part=part),
            event("response.output_item.done", output_index=index, item=item)]
