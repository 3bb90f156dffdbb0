"""A reply as the APIs return it: text and tool calls, read from the engine's outputs as they stream.

With tools in play (and a tool_choice other than none) the reply's text goes through the family's parser; for a
native template the text is decoded from the token ids with special tokens kept, since a family's call markers
(Qwen2.5's `<tool_call>`) may be special tokens the engine's text leaves out. Whitespace-only text next to calls
is dropped (the APIs return no empty text block beside a call). Without parallel calls
(`parallel_tool_calls: false`, `disable_parallel_tool_use`) only the first call of a reply is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from hafiza.engine.results import RequestOutput
from hafiza.models.tokenizer import Tokenizer
from hafiza.server.tools.formats import ToolFormat
from hafiza.server.tools.parse import CallPart, Part, TextPart, ToolCallParser
from hafiza.server.tools.spec import ToolCall, ToolChoice, ToolDef


class ReplyReader:
    """Turns one choice's engine outputs into text and call parts (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, fmt: ToolFormat, tools: list[ToolDef], choice: ToolChoice) -> None:
        self.tokenizer = tokenizer
        self.active = bool(tools) and choice.mode != "none"
        self.parser = ToolCallParser(fmt, {t.name for t in tools}, forced=choice.forced) if self.active else None
        self.own_decode = self.active and fmt.native
        self.parallel = choice.parallel
        self._ids: list[int] = []
        self._decoded = ""
        self._pending = ""
        self.calls: list[ToolCall] = []
        self.text = ""

    def feed(self, out: RequestOutput) -> list[Part]:
        """The parts this output adds."""
        if self.parser is None:
            self.text += out.text
            return [TextPart(out.text)] if out.text else []
        return self._settle(self.parser.feed(self._delta(out)), final=False)

    def finish(self) -> list[Part]:
        """What is left once the choice has finished."""
        if self.parser is None:
            return []
        return self._settle(self.parser.finish(), final=True)

    def _delta(self, out: RequestOutput) -> str:
        if not self.own_decode:
            return out.text
        eos = set(self.tokenizer.eos_token_ids)
        self._ids += [i for i in out.new_token_ids if i not in eos]
        full = self.tokenizer.decode(self._ids, skip_special=False)
        if full.endswith("\ufffd") and not out.finished:
            return ""
        delta, self._decoded = full[len(self._decoded):], full
        return delta

    def _settle(self, parts: list[Part], final: bool) -> list[Part]:
        out: list[Part] = []
        for part in parts:
            if isinstance(part, CallPart):
                if self.calls and not self.parallel:
                    continue
                self._pending = ""
                self.calls.append(part.call)
                out.append(part)
                continue
            self._pending += part.text
            if self._pending.strip():
                text = self._pending.lstrip() if not self.text and self.calls else self._pending
                self.text += text
                out.append(TextPart(text))
                self._pending = ""
        if final and self._pending and not self.calls:
            self.text += self._pending
            out.append(TextPart(self._pending))
            self._pending = ""
        return out


@dataclass(frozen=True)
class ToolUse:
    """A request's tools, tool_choice and the model's tool format: everything needed to read its replies."""

    fmt: ToolFormat
    tools: list[ToolDef]
    choice: ToolChoice

    def reader(self, tokenizer: Tokenizer) -> ReplyReader:
        return ReplyReader(tokenizer, self.fmt, self.tools, self.choice)
