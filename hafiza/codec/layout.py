"""How any tensor shape is seen as [groups, tokens, channels] and cut into independent token chunks."""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_CHUNK_TOKENS = 256


@dataclass(frozen=True)
class ChunkRef:
    """One chunk: group (layer) `group`, token rows [start, stop) of that group, all channels."""

    index: int
    group: int
    start: int
    stop: int


def view_shape(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """[L, T, *rest] -> (L, T, prod(rest)); [T, C] -> (1, T, C); [N] -> (1, N, 1); [] -> (1, 1, 1).

    A KV tensor [layers, tokens, kv_heads, head_dim] thus has one group per layer and one channel per
    (head, dim): the axis along which predictors and per-channel models work.
    """
    if len(shape) >= 3:
        return shape[0], shape[1], math.prod(shape[2:])
    if len(shape) == 2:
        return 1, shape[0], shape[1]
    if len(shape) == 1:
        return 1, shape[0], 1
    return 1, 1, 1


def chunks(shape: tuple[int, ...], chunk_tokens: int) -> list[ChunkRef]:
    """Every chunk of a tensor of `shape`, group-major; none when the tensor is empty."""
    groups, tokens, channels = view_shape(shape)
    if groups * tokens * channels == 0:
        return []
    out = []
    for g in range(groups):
        for start in range(0, tokens, chunk_tokens):
            out.append(ChunkRef(len(out), g, start, min(tokens, start + chunk_tokens)))
    return out
