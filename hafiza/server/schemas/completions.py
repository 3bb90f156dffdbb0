"""OpenAI legacy Completions (`POST /v1/completions`) and the tokenizer routes' request bodies."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from hafiza.server.schemas.openai import ChatMessage, SamplingFields, VllmFields
from hafiza.server.settings import MAX_CACHE_SALT_CHARS


class CompletionRequest(SamplingFields, VllmFields):
    """POST /v1/completions. `prompt`: a string, a list of strings, token ids, or a list of token-id lists.
    `echo` returns the prompt before the completion (with its logprobs, the first token's being null)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    best_of: int | None = Field(default=None, ge=1, le=16)
    suffix: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    speculative: bool | None = None  # hafiza: false never drafts tokens for this request


class TokenizeRequest(BaseModel):
    """POST /tokenize: a raw `prompt`, or chat `messages` rendered through the model's template."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    """POST /detokenize: token ids back to text (special tokens kept)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]
