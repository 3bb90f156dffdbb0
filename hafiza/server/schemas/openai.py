"""OpenAI Chat Completions request body: text messages, tools, structured output, sampling and logprobs.

Unknown fields are refused (400 naming them), as OpenAI does: a field the server would ignore is never accepted.
`user`, `metadata`, `store: false`, `service_tier`, `prompt_cache_key` and `safety_identifier` are accepted; they
do not change the output (they are billing or routing hints; caching here is automatic). The vLLM/SGLang
extensions vllm-router adds to every body (`VllmFields`, `ChatVllmFields`) are honoured, or refused at a value
that cannot be (hafiza/server/extensions.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from hafiza.server.settings import MAX_CACHE_SALT_CHARS

JsonSchema = dict[str, object]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str


class MessageToolCall(BaseModel):
    """A call in an assistant message of the history."""

    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    include_obfuscation: bool | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: JsonSchema | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: JsonSchema | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(BaseModel):
    """Fields shared by chat and legacy completions (vLLM's extensions `top_k`, `min_p`, `repetition_penalty`)."""

    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # int64, as torch's generator takes it
    n: int | None = Field(default=None, ge=1, le=16)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None


class VllmFields(BaseModel):
    """vLLM's (and SGLang's) request extensions that vllm-router adds to chat and completions bodies. Honoured:
    `ignore_eos`, `min_tokens`, `skip_special_tokens`, `no_stop_trim` (SGLang's name for vLLM's
    include_stop_str_in_output). Accepted only at the values that ask for nothing: `return_hidden_states`
    (false). `kv_transfer_params` is null except on a `--role prefill` or `--role decode` worker (see
    hafiza/server/pd.py)."""

    ignore_eos: bool | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    return_hidden_states: bool | None = None
    kv_transfer_params: dict[str, object] | None = None


class ChatVllmFields(VllmFields):
    """The chat-only extensions: `continue_final_message` (the reply continues the final assistant message,
    left open) and the reasoning flags, accepted at the values the served model needs nothing for."""

    continue_final_message: bool | None = None
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    include_reasoning: bool | None = None


class ChatCompletionRequest(SamplingFields, ChatVllmFields):
    """POST /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid")

    model: str
    messages: list[ChatMessage]
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    store: bool | None = None
    prompt_cache_key: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    speculative: bool | None = None  # hafiza: false never drafts tokens for this request
    safety_identifier: str | None = None
