"""Constrained decoding requests: OpenAI `response_format` and forced tool calls as grammar specs.

The grammar engine (hafiza.engine.grammar, xgrammar) makes every token of the reply keep it valid: a
`json_schema` reply always parses and validates against the schema, a forced tool call always names an allowed
tool with arguments valid against its input schema. The family's call prefix (`<tool_call>\\n`) is already at
the end of the prompt (convert.with_tools), so the grammar forces only the JSON call.
"""

from __future__ import annotations

import json

from hafiza.engine.grammar import GrammarSpec, ToolSpec, tool_call_grammar
from hafiza.server.errors import ApiError
from hafiza.server.schemas.openai import ResponseFormat
from hafiza.server.tools.formats import ToolFormat
from hafiza.server.tools.spec import ToolChoice, ToolDef


def response_format_grammar(fmt: ResponseFormat | None, where: str = "response_format") -> GrammarSpec | None:
    """json_object: any JSON object; json_schema: the schema (strict unless `strict: false`); text: none."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec("json_object")
    if fmt.json_schema is None:
        raise ApiError(400, f"{where}.json_schema: field required for type 'json_schema'", param=f"{where}.json_schema")
    schema = fmt.json_schema.schema_ or {"type": "object"}
    return GrammarSpec("json_schema", json.dumps(schema), strict=fmt.json_schema.strict is not False)


def tool_grammar(tools: list[ToolDef], choice: ToolChoice, fmt: ToolFormat) -> GrammarSpec | None:
    """For tool_choice required/any or a named tool: one call to an allowed tool, arguments per its schema."""
    if not choice.forced:
        return None
    allowed = [t for t in tools if choice.mode != "named" or t.name == choice.name]
    specs = [ToolSpec(name=t.name, parameters=t.parameters) for t in allowed]
    return tool_call_grammar(specs, begin="", end="", arguments_key=fmt.arguments_key)


def pick_grammar(tool: GrammarSpec | None, response: GrammarSpec | None) -> GrammarSpec | None:
    """A forced tool call and a response_format cannot both constrain one reply (400)."""
    if tool is not None and response is not None:
        raise ApiError(400, "response_format: cannot be combined with a forced tool_choice (the reply is the tool "
                            "call)", param="response_format")
    return tool or response
