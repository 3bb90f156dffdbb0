"""Anthropic Messages API request bodies (the subset hafiza serves: text, with cache_control breakpoints)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hafiza.server.settings import MAX_CACHE_SALT_CHARS


class CacheControl(BaseModel):
    """A cache breakpoint: everything up to and including the block it is on may be cached for `ttl`."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class ContentBlock(BaseModel):
    """A content block; `type` is checked when the prompt is built so unsupported kinds get a clear message."""

    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None
    cache_control: CacheControl | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[ContentBlock] | None = None
    is_error: bool | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(BaseModel):
    """A client tool: rendered into the prompt through the model's template (part of the cached prefix).
    Server tools (a `type` other than `custom`) are refused when the prompt is built."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None


class ToolChoice(BaseModel):
    """auto (default), any (some tool), tool (the named one), none (no call)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(BaseModel):
    """POST /v1/messages/count_tokens."""

    model_config = ConfigDict(extra="forbid")

    model: str
    messages: list[Message]
    system: str | list[ContentBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    cache_control: CacheControl | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=0)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    speculative: bool | None = None  # hafiza: false never drafts tokens for this request
    service_tier: Literal["auto", "standard_only"] | None = None
