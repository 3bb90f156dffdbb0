"""Per-family tool-call formats: how tools, calls and results reach the prompt, and what a call looks like.

- `hermes` (Qwen2.5, Hermes): the template renders `tools`; a call is `<tool_call>\\n{"name": …, "arguments": {…}}
  \\n</tool_call>`; results are `tool` messages (the template wraps them in `<tool_response>`).
- `llama3` (Llama 3.1–3.3): the template renders `tools` (in its system turn: `tools_in_user_message` is false, so
  tools stay ahead of the messages); a call is the bare JSON `{"name": …, "parameters": {…}}`.
- `native` (any other template that renders `tools`): the template renders tools and calls; replies are parsed
  as either of the two forms above.
- `generic` (templates without tools, e.g. SmolLM2's): a leading system turn lists the tools as JSON and asks for
  calls in the Hermes form; earlier calls are written in that form and results as `<tool_response>` user turns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from hafiza.models.tokenizer import Tokenizer

GENERIC_HEADER = (
    "You can call tools. To call one, answer with exactly <tool_call>{\"name\": <tool name>, \"arguments\": "
    "<arguments as a JSON object>}</tool_call> and nothing else; after the result comes back, answer the user. "
    "The tools, as JSON definitions:")


@dataclass(frozen=True)
class ToolFormat:
    """How one model family writes tool calls (see the module docstring)."""

    family: str
    native: bool
    arguments_key: str
    call_prefix: str
    call_suffix: str

    def template_vars(self) -> dict[str, object]:
        """Variables the family's template reads to place tools ahead of the messages."""
        return {"tools_in_user_message": False} if self.family == "llama3" else {}

    def call_text(self, name: str, arguments: str) -> str:
        """A call written the way this family writes it (for histories rendered without the template's help)."""
        body = f'{{"name": {json.dumps(name)}, "{self.arguments_key}": {arguments}}}'
        return f"{self.call_prefix}{body}{self.call_suffix}"


HERMES = ToolFormat("hermes", True, "arguments", "<tool_call>\n", "\n</tool_call>")
LLAMA3 = ToolFormat("llama3", True, "parameters", "", "")
NATIVE = ToolFormat("native", True, "arguments", "", "")
GENERIC = ToolFormat("generic", False, "arguments", "<tool_call>", "</tool_call>")


def tool_format(tokenizer: Tokenizer) -> ToolFormat:
    """The format of the model's chat template: Hermes tags, Llama 3 JSON, another native one, or generic."""
    template = tokenizer.chat_template or ""
    if not tokenizer.template_supports_tools:
        return GENERIC
    if "<tool_call>" in template:
        return HERMES
    if "<|start_header_id|>" in template and '"parameters"' in template:
        return LLAMA3
    return NATIVE
