"""A cheaper copy of the target model for the speculative codec, run in one chunked pass over a prefix.

The copy is a LlamaModel built from the target's own weight values in another run-time format (fp32, bf16, int8 or
int4 weights; fp32 or bf16 compute), optionally keeping the target's first `exact_layers` layers as they are and
optionally stopping after `layers` layers (the rest predicted as zeros: plain coding). It runs the engine's forward,
whose pieces are row-invariant (the linears, `invariant_attention` with fixed key tiles), and every chunk reads the
K/V of earlier tokens back from a buffer in the store's dtype, as the engine reads its pool. So block i's predicted
K/V depend only on the tokens up to the end of block i: the same whether the pass covers i + 1 blocks or 40, and
whatever the chunk size (tests/codec/test_cheap_predictor.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hafiza.models.attention import AttentionMetadata, PrefillSpan
from hafiza.models.linear import DenseLinear, Int4Linear, Int8Linear, Linear
from hafiza.models.llama import LlamaModel
from hafiza.models.weights import LayerWeights, ModelWeights, requantize_int4

WEIGHT_FORMATS = ("same", "fp32", "fp32-bf16in", "bf16", "int8", "int4")
DEFAULT_CHUNK = 256  # tokens per forward: big matmuls, a bounded score matrix


@dataclass(frozen=True)
class CheapSpec:
    """What the cheaper model is: weight format of the non-exact layers, compute dtype, exact leading layers and
    how many layers run at all (None: every layer)."""

    weights: str = "fp32-bf16in"
    dtype: str = "fp32"
    exact_layers: int = 0
    layers: int | None = None

    def label(self) -> str:
        tail = f":top{self.layers}" if self.layers is not None else ""
        return f"{self.weights}:{self.dtype}:exact{self.exact_layers}{tail}"


class _BF16Inputs:
    """An fp32 dense linear whose input is rounded to bf16 first: the int4/int8 kernels' own input rounding,
    with MKL's fp32 GEMM (on a CPU without bf16 units it is several times faster than the packed kernels)."""

    def __init__(self, inner: DenseLinear) -> None:
        self.inner, self.parts = inner, [inner]
        self.kind, self.out_features, self.in_features = "fp32-bf16in", inner.out_features, inner.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.to(torch.bfloat16).to(x.dtype))

    def dense(self) -> torch.Tensor:
        return self.inner.dense()

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes


class _CastRows:
    """The target's embedding table, its rows cast to the cheaper model's compute dtype."""

    def __init__(self, rows: object, dtype: torch.dtype) -> None:
        self.rows, self.dtype = rows, dtype
        self.kind = "shared"

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids).to(self.dtype)  # type: ignore[operator]

    def dense(self) -> torch.Tensor:
        return self.rows.dense()  # type: ignore[attr-defined]

    @property
    def nbytes(self) -> int:
        return 0


def _linear(lin: Linear, fmt: str, device: torch.device) -> Linear:
    """The target's linear `lin` rebuilt in `fmt` from the values it computes with."""
    w = lin.dense().to(device)
    if fmt == "fp32":
        return DenseLinear(w.float())
    if fmt == "fp32-bf16in":
        return _BF16Inputs(DenseLinear(w.float()))  # type: ignore[return-value]
    if fmt == "bf16":
        return DenseLinear(w.to(torch.bfloat16))
    if fmt == "int8":
        return Int8Linear.quantize(w.float().cpu(), device)
    if fmt == "int4":
        q, scale, zero = requantize_int4(w.float().cpu())
        return Int4Linear.from_ints(q, scale, zero, device)
    raise ValueError(f"unknown predictor weight format {fmt!r}: {', '.join(WEIGHT_FORMATS)}")


def build_cheap_model(target: LlamaModel, spec: CheapSpec) -> LlamaModel:
    """The cheaper copy of `target` that `spec` describes (weights converted once; the embedding is shared)."""
    if spec.weights not in WEIGHT_FORMATS:
        raise ValueError(f"unknown predictor weight format {spec.weights!r}: {', '.join(WEIGHT_FORMATS)}")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(spec.dtype)
    if dtype is None:
        raise ValueError(f"predictor compute dtype must be fp32 or bf16, not {spec.dtype!r}")
    total = len(target.layers)
    count = total if spec.layers is None else max(1, min(spec.layers, total))
    exact = min(max(spec.exact_layers, 0), count)
    if exact and dtype != target.dtype:
        raise ValueError(f"exact layers need the target's compute dtype {target.dtype}, not {dtype}")
    layers = []
    for i, lw in enumerate(target.layers[:count]):
        if i < exact or spec.weights == "same":
            layers.append(lw if dtype == target.dtype else LayerWeights(
                lw.input_norm.to(dtype), lw.qkv, None if lw.qkv_bias is None else lw.qkv_bias.to(dtype), lw.o,
                lw.post_norm.to(dtype), lw.gate_up, lw.down))
            continue
        layers.append(LayerWeights(
            input_norm=lw.input_norm.to(dtype), qkv=_linear(lw.qkv, spec.weights, target.device),
            qkv_bias=None if lw.qkv_bias is None else lw.qkv_bias.to(dtype),
            o=_linear(lw.o, spec.weights, target.device), post_norm=lw.post_norm.to(dtype),
            gate_up=_linear(lw.gate_up, spec.weights, target.device),
            down=_linear(lw.down, spec.weights, target.device)))
    weights = ModelWeights(_CastRows(target.embed, dtype), target.norm.to(dtype), target.lm_head, layers,  # type: ignore[arg-type]
                           target.weights.rope_freqs, f"predictor-{spec.weights}")
    return LlamaModel(target.config, weights, dtype, target.device)


class PrefixRun:
    """One sequence's predicted K/V [layers, T, kv_heads, head_dim] in the store's dtype, grown chunk by chunk.

    Stands in for the pool in `LlamaModel.forward` (write and gather): every chunk attends to the K/V read back
    from here, in `kv_dtype`, exactly as the engine attends to its pool."""

    def __init__(self, model: LlamaModel, num_layers: int, kv_dtype: torch.dtype) -> None:
        c = model.config
        self.model, self.num_layers, self.kv_dtype = model, num_layers, kv_dtype
        self.tokens: list[int] = []
        self._shape = (len(model.layers), c.num_kv_heads, c.head_dim)
        self.k = torch.zeros(self._shape[0], 0, *self._shape[1:], dtype=kv_dtype, device=model.device)
        self.v = torch.zeros_like(self.k)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer, slots] = k.to(self.kv_dtype)
        self.v[layer, slots] = v.to(self.kv_dtype)

    def truncate(self, n: int) -> None:
        """Keep the first `n` tokens (a shared prefix with the next request)."""
        del self.tokens[n:]

    def _reserve(self, n: int) -> None:
        have = self.k.shape[1]
        if n <= have:
            return
        size = max(n, 2 * have, 256)
        grown = torch.zeros(self._shape[0], size, *self._shape[1:], dtype=self.kv_dtype, device=self.model.device)
        grown_v = torch.zeros_like(grown)
        grown[:, :have], grown_v[:, :have] = self.k, self.v
        self.k, self.v = grown, grown_v

    @torch.inference_mode()
    def extend(self, token_ids: list[int], chunk: int = DEFAULT_CHUNK) -> None:
        """Run the model over `token_ids` after the tokens already here, `chunk` tokens per forward."""
        if chunk < 1:
            raise ValueError(f"chunk={chunk} must be >= 1")
        m = self.model
        self._reserve(len(self.tokens) + len(token_ids))
        for a in range(0, len(token_ids), chunk):
            part = token_ids[a : a + chunk]
            p0, n = len(self.tokens), len(part)
            positions = torch.arange(p0, p0 + n, device=m.device)
            span = PrefillSpan(0, n, p0 + n, block_table=torch.zeros(1, dtype=torch.long, device=m.device))
            # the view up to p0 + n keeps gather's key count (and so the padding) a function of p0 + n alone
            view = _View(self, p0 + n)
            m.forward(torch.tensor(part, dtype=torch.long, device=m.device), positions,
                      AttentionMetadata(slot_mapping=positions, prefills=[span]), view)  # type: ignore[arg-type]
            self.tokens.extend(part)

    def kv(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of tokens start..stop-1, [num_layers, stop - start, kv_heads, head_dim]; layers the model does
        not run are zeros."""
        k, v = self.k[:, start:stop], self.v[:, start:stop]
        missing = self.num_layers - k.shape[0]
        if missing > 0:
            pad = k.new_zeros(missing, *k.shape[1:])
            k, v = torch.cat([k, pad]), torch.cat([v, pad])
        return k, v


class _View:
    """A PrefixRun's first `n` tokens, as the forward's pool."""

    def __init__(self, run: PrefixRun, n: int) -> None:
        self.run, self.n = run, n

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.run.write(layer, slots, k, v)

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.run.k[layer, : self.n].unsqueeze(0), self.run.v[layer, : self.n].unsqueeze(0)


def cheap_kv(model: LlamaModel, num_layers: int, token_ids: list[int], kv_dtype: torch.dtype,
             chunk: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V predicted for `token_ids` in one chunked pass, each [num_layers, T, kv_heads, head_dim]."""
    run = PrefixRun(model, num_layers, kv_dtype)
    run.extend(list(token_ids), chunk)
    return run.kv(0, len(token_ids))
