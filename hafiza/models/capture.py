"""Run a prompt once and capture every layer's K/V contiguously: the codec's and benchmarks' source of real KV."""

from __future__ import annotations

import torch

from hafiza.models.attention import AttentionMetadata, PrefillSpan
from hafiza.models.llama import LlamaModel


class ContiguousKV:
    """Stands in for a KVPool in the forward (write and gather only): one sequence's K/V as [layers, T, Hkv, d],
    slots are token positions."""

    def __init__(self, model: LlamaModel, num_tokens: int, dtype: torch.dtype | None = None) -> None:
        c = model.config
        shape = (c.num_layers, num_tokens, c.num_kv_heads, c.head_dim)
        self.k = torch.zeros(shape, dtype=dtype or model.dtype, device=model.device)
        self.v = torch.zeros(shape, dtype=dtype or model.dtype, device=model.device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer, slots] = k.to(self.k.dtype)
        self.v[layer, slots] = v.to(self.v.dtype)

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block tables are ignored: the sequence is contiguous, block 0 is the whole of it."""
        return self.k[layer].unsqueeze(0), self.v[layer].unsqueeze(0)


def compute_kv(
    model: LlamaModel, token_ids: list[int], kv_dtype: torch.dtype | None = None, chunk: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every layer for `token_ids`, each [layers, T, kv_heads, head_dim] in `kv_dtype`.

    With `chunk`, the prompt is prefilled in pieces that read earlier pieces back from the stored KV,
    as a chunked-prefill engine does; without it, one causal prefill.
    """
    n = len(token_ids)
    store = ContiguousKV(model, n, kv_dtype)
    ids = torch.tensor(token_ids, dtype=torch.long, device=model.device)
    step = chunk or n
    for start in range(0, n, step):
        end = min(n, start + step)
        length = end - start
        positions = torch.arange(start, end, device=model.device)
        if start == 0:
            span = PrefillSpan(0, length, length)
        else:
            keys = torch.arange(end, device=model.device)
            mask = keys.unsqueeze(0) <= positions.unsqueeze(1)
            padded = torch.zeros(length, n, dtype=torch.bool, device=model.device)
            padded[:, :end] = mask
            span = PrefillSpan(0, length, n, block_table=torch.zeros(1, dtype=torch.long), mask=padded)
        model.forward(ids[start:end], positions, AttentionMetadata(slot_mapping=positions, prefills=[span]), store)
    return store.k, store.v
