"""The quality benchmark's transformers peer: its QuantizedCache (quanto, HQQ, fp8 backends) on the same weights and
tokens, in the same chunks as the engine's prefill."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hafiza.bench.quality_runs import TextRun
from hafiza.cache.memory import kv_bytes_per_token


@dataclass(frozen=True)
class PeerCache:
    """One transformers cache set-up: the constructor and the bytes per stored value it implies."""

    name: str
    make: Callable[[Any], Any]
    bits_per_value: float
    note: str


def _quantized(backend: str, **kwargs: Any) -> Callable[[Any], Any]:
    def make(config: Any) -> Any:
        from transformers.cache_utils import QuantizedCache

        return QuantizedCache(backend, config, **kwargs)

    return make


def _dynamic(config: Any) -> Any:
    from transformers.cache_utils import DynamicCache

    return DynamicCache(config=config)


def next_token_nll(logits: torch.Tensor, targets: list[int]) -> float:
    """Summed cross-entropy of `targets` under `logits` rows (row i predicts targets[i])."""
    t = torch.tensor(targets, dtype=torch.long, device=logits.device)
    return float(F.cross_entropy(logits[: len(targets)].float(), t, reduction="sum"))


PEERS = (
    PeerCache("hf-dynamic", _dynamic, 32.0, "full precision (fp32) DynamicCache: the peer's own baseline"),
    PeerCache("hf-quanto-int4", _quantized("quanto", nbits=4), 4 + 2 * 32 / 64,
              "optimum-quanto int4, group 64, fp32 scale+zero, residual 128 tokens in full precision"),
    PeerCache("hf-hqq-int4", _quantized("hqq", nbits=4, axis_key=1, axis_value=1), 4 + 2 * 32 / 64,
              "HQQ int4 along axis 1 (transformers' documented HQQ setting), group 64, fp32 scale+zero, "
              "residual 128 tokens in full precision"),
    PeerCache("hf-fp8", _quantized("fp8"), 8.0, "fp8 e4m3, one scale per tensor"),
)


def run_peer(hf_model: Any, ids: list[int], peer: PeerCache, chunk: int = 64, gen_tokens: int = 64) -> TextRun:
    """Chunked perplexity of `ids` through the peer's cache, then greedy tokens at the end of the text."""
    cache = peer.make(hf_model.config)
    dev = next(hf_model.parameters()).device
    run = TextRun()
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            end = min(len(ids), start + chunk)
            x = torch.tensor([ids[start:end]], device=dev)
            logits = hf_model(input_ids=x, past_key_values=cache, use_cache=True).logits[0]
            targets = ids[start + 1 : end + 1]
            run.nll_sum += next_token_nll(logits, targets)
            run.scored += len(targets)
        out = [int(logits[-1].argmax())]
        while len(out) < gen_tokens:
            x = torch.tensor([[out[-1]]], device=dev)
            out.append(int(hf_model(input_ids=x, past_key_values=cache, use_cache=True).logits[0, -1].argmax()))
    run.continuations[len(ids)] = out
    return run


def peer_bytes_per_token(peer: PeerCache, num_layers: int, num_kv_heads: int, head_dim: int) -> float:
    """Stored bytes per token implied by the peer's bits per value (residual window not counted)."""
    return kv_bytes_per_token(num_layers, num_kv_heads, head_dim * peer.bits_per_value / 8)
