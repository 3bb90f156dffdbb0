"""A cheaper rerun of the target's forward returning every layer's K and V (the speculative model).

Built from the target LlamaModel's own weights and pieces (rms_norm, RoPE, SDPA). Per layer, a precision:
  exact      the target's own linears and attention kernel (LlamaModel.forward's operations), so its K/V equal the
             target's bit for bit
  bf16-mixed matmuls in bf16 (weights and inputs rounded), residual stream, norms and attention in fp32
  bf16       everything in bf16 (the target's weights run as a bf16 model)
  int8       matmuls in int8 (weights per output channel, activations per token), the rest in fp32
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hafiza.models.attention import AttentionMetadata, PrefillSpan, paged_attention
from hafiza.models.capture import ContiguousKV
from hafiza.models.llama import LayerWeights, LlamaModel, rms_norm
from hafiza.models.rope import apply_rope

VARIANTS = ("exact", "bf16-mixed", "bf16", "int8")


@dataclass
class Int8Weight:
    """A weight matrix [out, in] as int8 with one fp32 scale per output row."""

    q: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def of(cls, w: torch.Tensor) -> Int8Weight:
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        q = (w * (1.0 / scale)[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        return cls(q.t().contiguous(), scale.float())


def _int8_linear(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    sx = x.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    xq = torch.round(x / sx[:, None]).clamp(-127, 127).to(torch.int8)
    rows = xq.shape[0]
    pad = (-rows) % 32 if rows <= 16 else 0
    if pad:
        xq = torch.cat([xq, xq.new_zeros(pad, xq.shape[1])])
    y = torch._int_mm(xq, w.q)[:rows]
    return y.float() * sx[:, None] * w.scale[None, :]


class _Linears:
    """One layer's four matmuls at one precision: maps fp32 (or bf16) activations to the residual dtype."""

    def __init__(self, lw: LayerWeights, variant: str, target: LlamaModel) -> None:
        self.variant, self.layer = variant, lw
        names = ("qkv", "o", "gate_up", "down")
        if variant == "int8":
            self.w = {n: Int8Weight.of(getattr(lw, n).dense()) for n in names}
        elif variant in ("bf16-mixed", "bf16"):
            self.w = {n: getattr(lw, n).dense().to(torch.bfloat16) for n in names}
        else:
            self.w = {}
        self.bias = lw.qkv_bias

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if name == "qkv" else None
        if self.variant == "exact":
            y = getattr(self.layer, name)(x)
            return y if bias is None else y + bias
        w = self.w[name]
        if self.variant == "int8":
            y = _int8_linear(x.float(), w)
            return y if bias is None else y + bias.float()
        if self.variant == "bf16-mixed":
            y = F.linear(x.to(torch.bfloat16), w, None if bias is None else bias.to(torch.bfloat16))
            return y.float()
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))


class PredictorModel:
    """The target's weights prepared for a forward: the first `exact_layers` exact, the rest `variant`.

    It refers to the target weakly, so a cache of prepared models keyed by their target (speculative.prepared)
    lets the target go; whoever runs it holds the target."""

    def __init__(self, target: LlamaModel, variant: str, exact_layers: int) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"unknown speculative variant {variant!r}: {', '.join(VARIANTS)}")
        self._target, self.variant = weakref.ref(target), variant
        self.exact_layers = min(max(exact_layers, 0), target.config.num_layers)
        self.linears = [_Linears(lw, "exact" if i < self.exact_layers else variant, target)
                        for i, lw in enumerate(target.layers)]
        self.bf16_norms = [(lw.input_norm.to(torch.bfloat16), lw.post_norm.to(torch.bfloat16))
                           for lw in target.layers]

    @property
    def target(self) -> LlamaModel:
        """The target model (it must still be alive: its holder runs this)."""
        target = self._target()
        if target is None:
            raise ReferenceError("the speculative predictor's target model is gone")
        return target

    @torch.inference_mode()
    def kv(self, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [layers, T, kv_heads, head_dim] in fp32 (exact layers hold the target's values)."""
        m, c = self.target, self.target.config
        t = len(token_ids)
        ids = torch.tensor(token_ids, dtype=torch.long, device=m.device)
        positions = torch.arange(t, device=m.device)
        cos, sin = m.rope.cos_sin(positions, t - 1)
        ks, vs = [], []
        exact_kv = ContiguousKV(m, 1) if self.exact_layers else None
        meta = AttentionMetadata(slot_mapping=positions, prefills=[PrefillSpan(0, t, t)])
        x = m.embed(ids)
        for i, lw in enumerate(m.layers):
            low = "bf16" if (i >= self.exact_layers and self.variant == "bf16") else None
            x = x.to(torch.bfloat16) if low else x.to(m.dtype)
            in_norm, post_norm = self.bf16_norms[i] if low else (lw.input_norm, lw.post_norm)
            cs, sn = (cos.to(torch.bfloat16), sin.to(torch.bfloat16)) if low else (cos, sin)
            lin = self.linears[i]
            h = rms_norm(x, in_norm, c.rms_norm_eps)
            q, k, v = lin("qkv", h).split([m.q_size, m.kv_size, m.kv_size], dim=-1)
            q = apply_rope(q.reshape(t, c.num_heads, c.head_dim), cs, sn)
            k = apply_rope(k.reshape(t, c.num_kv_heads, c.head_dim), cs, sn)
            v = v.reshape(t, c.num_kv_heads, c.head_dim)
            ks.append(k.float())
            vs.append(v.float())
            if exact_kv is not None and i < self.exact_layers:  # the target's kernel: fresh K/V, one causal span
                attn = paged_attention(i, q, k, v, exact_kv, meta).reshape(t, m.q_size)
            else:
                qh, kh, vh = (a.transpose(0, 1).unsqueeze(0) for a in (q, k, v))
                o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True,
                                                   enable_gqa=c.num_heads != c.num_kv_heads)
                attn = o[0].transpose(0, 1).reshape(t, m.q_size)
            x = x + lin("o", attn).to(x.dtype)
            h = rms_norm(x, post_norm, c.rms_norm_eps)
            gate, up = lin("gate_up", h).chunk(2, dim=-1)
            x = x + lin("down", F.silu(gate) * up).to(x.dtype)
        return torch.stack(ks), torch.stack(vs)
