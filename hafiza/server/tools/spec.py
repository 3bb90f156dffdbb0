"""Tool definitions, tool choices and tool calls, in one form for both APIs."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Literal

from hafiza.server.errors import ApiError

JsonObject = dict[str, object]
ChoiceMode = Literal["auto", "required", "none", "named"]


@dataclass(frozen=True)
class ToolDef:
    """One function the model may call; `parameters` is its JSON Schema (Anthropic's `input_schema`)."""

    name: str
    description: str | None
    parameters: JsonObject

    def openai_form(self) -> JsonObject:
        """The `{"type": "function", "function": {...}}` form chat templates (and Hugging Face) expect."""
        fn: JsonObject = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    """auto: the model decides; required: some tool must be called; named: that tool; none: no call."""

    mode: ChoiceMode = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


@dataclass
class ToolCall:
    """A call the model made: `arguments` is the JSON text of a JSON object."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    @property
    def input(self) -> JsonObject:
        value = json.loads(self.arguments)
        assert isinstance(value, dict)
        return value


def check_tools(tools: list[ToolDef], choice: ToolChoice, where: str) -> None:
    """400 for duplicate names, a choice naming an unknown tool, or a forced choice without tools."""
    names = [t.name for t in tools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ApiError(400, f"{where}: tool names must be unique, {dup[0]!r} appears {names.count(dup[0])} times",
                       param=where)
    if choice.forced and not tools:
        raise ApiError(400, f"tool_choice: {choice.mode!r} needs at least one tool in {where}", param="tool_choice")
    if choice.mode == "named" and choice.name not in names:
        raise ApiError(400, f"tool_choice: no tool named {choice.name!r} in {where} (tools: {', '.join(names)})",
                       param="tool_choice")
