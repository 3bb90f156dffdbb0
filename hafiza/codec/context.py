"""CodecContext: what encode and decode are told besides the bytes (coder, predictor, tokens, role)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hafiza.codec.layout import DEFAULT_CHUNK_TOKENS


@dataclass
class CodecContext:
    """Options for encode (coder, predictor, chunking) and what a decoder must supply again.

    `coder` and `predictor` are names or instances. For the speculative predictor (an instance holding the
    model), `token_ids` let the decoder rerun it and `role` says whether the tensor is 'k' or 'v'.
    """

    coder: Any = "exponent"
    predictor: Any = None
    token_ids: Sequence[int] | None = None
    role: str = "k"
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
