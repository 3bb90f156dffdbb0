"""Parse tool calls out of the model's reply as it streams: text passes through, each call comes out whole.

Two shapes are recognised (see formats.py): calls wrapped in `<tool_call>…</tool_call>` (or in a ```json fence,
as Qwen2.5-Coder writes them; llama.cpp accepts that too) anywhere in the reply (Hermes, generic), and a reply
that is one JSON call or several separated by `;` (Llama 3, after an optional `<|python_tag|>`). A call is kept
only if it is a JSON object naming one of the request's tools with an object of arguments; anything else stays
text, so a malformed call (or a fenced JSON that is no call) is never reported as one."""

from __future__ import annotations

import json
from dataclasses import dataclass

from hafiza.server.tools.formats import ToolFormat
from hafiza.server.tools.spec import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FENCES = ((OPEN, CLOSE), ("```json", "```"))
PYTHON_TAG = "<|python_tag|>"


@dataclass
class TextPart:
    text: str


@dataclass
class CallPart:
    call: ToolCall


Part = TextPart | CallPart


def parse_call(text: str, names: set[str]) -> ToolCall | None:
    """One `{"name": …, "arguments"|"parameters": {…}}` object, or None if `text` is not exactly that."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return _call_from(value, names)


def _call_from(value: object, names: set[str]) -> ToolCall | None:
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(str(value["name"]), json.dumps(args, ensure_ascii=False))


def parse_json_calls(text: str, names: set[str]) -> list[ToolCall] | None:
    """A reply made only of JSON calls (Llama 3 style, `;` or whitespace between them), or None."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos = 0
    while pos < len(body):
        try:
            value, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return None
        call = _call_from(value, names)
        if call is None:
            return None
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return calls or None


class ToolCallParser:
    """Feed the reply's text as it arrives; get back text to show and calls as soon as each is complete.

    `forced`: the prompt already ended with the family's call prefix and a grammar makes the reply one call."""

    def __init__(self, fmt: ToolFormat, names: set[str], forced: bool = False) -> None:
        self.fmt, self.names, self.forced = fmt, names, forced
        self.tagged = fmt.family in ("hermes", "generic", "native")
        self.json_first = fmt.family in ("llama3", "native")
        self._buf = ""
        self._in_call = forced and bool(fmt.call_prefix)
        self._fence = FENCES[0]
        self._mode = "json" if forced and not fmt.call_prefix else ("undecided" if self.json_first else "text")
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[Part]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[Part]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Part]:
        out: list[Part] = []
        if self._mode == "undecided":
            head = self._buf.lstrip()
            if not head and not final:
                return out
            is_json = head.startswith("{") or head.startswith(PYTHON_TAG) or (
                not final and PYTHON_TAG.startswith(head))
            self._mode = "json" if is_json else "text"
        if self._mode == "json":
            if not final:
                return out
            calls = parse_json_calls(self._buf, self.names)
            if calls is None and self.tagged and OPEN in self._buf:
                self._mode = "text"
                return self._drain(final)
            out += [CallPart(c) for c in calls] if calls else ([TextPart(self._buf)] if self._buf else [])
            self.calls += calls or []
            self._buf = ""
            return out
        while True:
            if self._in_call:
                opener, closer = self._fence
                end = self._buf.find(closer)
                if end < 0 and not final:
                    return out
                inner = self._buf if end < 0 else self._buf[:end]
                rest = "" if end < 0 else self._buf[end + len(closer):]
                call = parse_call(inner.strip(), self.names)
                if call is not None:
                    self.calls.append(call)
                    out.append(CallPart(call))
                else:
                    raw = ("" if self.forced and not self.calls else opener) + inner + ("" if end < 0 else closer)
                    out.append(TextPart(raw))
                self._in_call, self._buf = False, rest
                if end < 0:
                    return out
                continue
            hits = [(self._buf.find(o), (o, c)) for o, c in FENCES] if self.tagged else []
            hits = [h for h in hits if h[0] >= 0]
            if hits:
                start, self._fence = min(hits, key=lambda h: h[0])
                if start:
                    out.append(TextPart(self._buf[:start]))
                self._buf, self._in_call = self._buf[start + len(self._fence[0]):], True
                continue
            keep = 0 if final or not self.tagged else max(_partial_suffix(self._buf, o) for o, _ in FENCES)
            text = self._buf[: len(self._buf) - keep]
            if text:
                out.append(TextPart(text))
            self._buf = self._buf[len(self._buf) - keep:]
            return out


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker` (held back while streaming)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def split_reply(text: str, fmt: ToolFormat, names: set[str], forced: bool = False) -> tuple[str, list[ToolCall]]:
    """A whole reply as (its text outside calls, its calls)."""
    parser = ToolCallParser(fmt, names, forced)
    parts = parser.feed(text) + parser.finish()
    return "".join(p.text for p in parts if isinstance(p, TextPart)), parser.calls
