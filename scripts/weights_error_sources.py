"""Where the quantized default model's error comes from: logits error and perplexity of one variant at a time
(the int4 layers emulated or through the kernel, or the old int8 per-channel head) against the exact fp32 model.

Every variant swaps only the linears it names into an fp32 model, so each error source is measured alone
(docs/WEIGHTS.md, "Where the quantized default model's error came from"). It measures the CPU kernels, so it runs
on the CPU. Usage: python scripts/weights_error_sources.py [--variants V ...] [--tokens N] [--threads T]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path

import numpy as np
import torch

from hafiza.cache.pool import layout_for, make_kv_pool
from hafiza.models import load_model
from hafiza.models.attention import AttentionMetadata, PrefillSpan
from hafiza.models.gguf_file import config_from_gguf, gguf_fields, gguf_sources, open_gguf
from hafiza.models.linear import INT4_GROUP, Int4Linear, Linear, cpu_fp32_linear
from hafiza.models.llama import LlamaModel
from hafiza.models.loader import LoadedModel, default_model_path
from hafiza.models.weights import LayerWeights, Source, build_linear

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ROOT / "bench" / "texts" / "quality"
CPU = torch.device("cpu")  # the kernels under study are the CPU ones
PROMPT = "What is the capital of France?"
# variant -> (scale + zero rounded to bf16, activations rounded to bf16, output rounded to bf16), emulated in fp32
EMULATED = {
    "emu_bf16sz": (True, False, False),
    "emu_bf16act": (False, True, True),
    "emu_bf16act_in": (False, True, False),
    "emu_bf16out": (False, False, True),
    "emu_all": (True, True, True),
}
VARIANTS = ("auto", "old_auto", "head_int8", "kernel_fp32", *EMULATED)
DEFAULT_VARIANTS = ["old_auto", "kernel_fp32", "emu_bf16sz", "emu_bf16act", "emu_all", "head_int8"]


class EmulatedLinear:
    """fp32 weights w, with optional bf16 rounding of the input and of the output: one kernel rounding alone."""

    kind = "emu"
    nbytes = 0

    def __init__(self, w: torch.Tensor, round_in: bool, round_out: bool) -> None:
        self.w, self.round_in, self.round_out = w, round_in, round_out
        self.out_features, self.in_features = w.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.round_in:
            x = x.bfloat16().float()
        y = cpu_fp32_linear(x, self.w)
        return y.bfloat16().float() if self.round_out else y

    def dense(self) -> torch.Tensor:
        return self.w


class Fp32Int4Linear:
    """torch's CPU int4 kernel fed fp32 activations and fp32 scale + zero (Int4Linear uses bf16 for both)."""

    kind = "int4-fp32"

    def __init__(self, q: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> None:
        self.packed = Int4Linear.from_ints(q, scale, zero, CPU).packed  # the kernel's layout, as Int4Linear packs it
        n, k = q.shape
        self.scale_zero = torch.empty(k // INT4_GROUP, n, 2)
        self.scale_zero[..., 0], self.scale_zero[..., 1] = torch.from_numpy(scale).t(), torch.from_numpy(zero).t()
        self.out_features, self.in_features = n, k

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.float(), self.packed, INT4_GROUP, self.scale_zero)

    def dense(self) -> torch.Tensor:
        return self(torch.eye(self.in_features)).t().contiguous()

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scale_zero.numel() * 4


def int4_parts(srcs: dict[str, Source], names: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The 4-bit tensors `names` row-concatenated as Int4Linear's (q, scale, zero): w = (q - 8) * scale + zero."""
    qs, ss, zs = [], [], []
    for n in names:
        g = srcs[n].read(0, srcs[n].rows)
        qs.append(g.q)
        ss.append(g.scale)
        zs.append(g.zero + np.float32(8) * g.scale)
    return np.concatenate(qs), np.concatenate(ss), np.concatenate(zs)


def bf16(a: np.ndarray) -> np.ndarray:
    """fp32 values rounded to bf16 and back."""
    return torch.from_numpy(a).bfloat16().float().numpy()


def dequant(q: np.ndarray, s: np.ndarray, z: np.ndarray, round_sz: bool) -> torch.Tensor:
    """fp32 [N, K] weights from Int4Linear's (q, scale, zero), with scale and zero optionally rounded to bf16."""
    if round_sz:
        s, z = bf16(s), bf16(z)
    n, k = q.shape
    return torch.from_numpy(((q.reshape(n, -1, 32).astype(np.float32) - 8) * s[..., None] + z[..., None]).reshape(n, k))


def layer_groups(i: int) -> dict[str, list[str]]:
    """The tensors of layer i behind each fused linear of LayerWeights."""
    p = f"model.layers.{i}."
    return {"qkv": [p + f"self_attn.{x}_proj.weight" for x in "qkv"], "o": [p + "self_attn.o_proj.weight"],
            "gate_up": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], "down": [p + "mlp.down_proj.weight"]}


def int8_head(srcs: dict[str, Source]) -> Linear:
    """The tied head as int8 per output channel, as the old `auto` built it (today's `q8`)."""
    return build_linear([srcs["model.embed_tokens.weight"]], "q8", CPU)


def build(variant: str, ref: LoadedModel, auto: LoadedModel, srcs: dict[str, Source]) -> LlamaModel:
    """The model of one variant: the exact fp32 model with only that variant's linears swapped in."""
    cfg = ref.model.config
    if variant == "auto":
        return auto.model
    if variant == "old_auto":
        mw = dataclasses.replace(auto.model.weights, lm_head=int8_head(srcs))
        return LlamaModel(cfg, mw, auto.model.dtype, CPU)
    rw = ref.model.weights
    layers = []
    for i, lw in enumerate(rw.layers):
        lin: dict[str, Linear] = {}
        for key, names in layer_groups(i).items():
            if variant == "head_int8":
                lin[key] = getattr(lw, key)
                continue
            q, s, z = int4_parts(srcs, names)
            if variant == "kernel_fp32":
                lin[key] = Fp32Int4Linear(q, s, z)
            else:
                round_sz, round_in, round_out = EMULATED[variant]
                lin[key] = EmulatedLinear(dequant(q, s, z, round_sz), round_in, round_out)
        layers.append(LayerWeights(lw.input_norm, lin["qkv"], lw.qkv_bias, lin["o"], lw.post_norm, lin["gate_up"],
                                   lin["down"]))
    head = int8_head(srcs) if variant == "head_int8" else rw.lm_head
    return LlamaModel(cfg, dataclasses.replace(rw, lm_head=head, layers=layers), torch.float32, CPU)


def logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """fp32 logits of every position of `ids`, one prefill into a fresh fp32 pool."""
    n = len(ids)
    pool = make_kv_pool(layout_for(model.config, n // 16 + 2, 16, "fp32", torch.float32), "cpu")
    meta = AttentionMetadata(slot_mapping=torch.arange(n), prefills=[PrefillSpan(0, n, n)])
    with torch.inference_mode():
        h = model.forward(torch.tensor(ids), torch.arange(n), meta, pool)
        return model.logits(h).float()


def nll(logits_: torch.Tensor, ids: list[int]) -> float:
    """Mean negative log-likelihood of ids[1:] under the logits of ids[:-1]."""
    lp = torch.log_softmax(logits_[:-1].float(), -1)
    return -lp.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()


def main() -> None:
    """Print the reference perplexity, then one line per variant."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=DEFAULT_VARIANTS)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens of the first quality text (default 1024)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = default_model_path()
    ref = load_model(path, weights="fp32", device="cpu")
    auto = load_model(path, weights="auto", device="cpu")
    tok = ref.tokenizer
    header = open_gguf(path)
    cfg = config_from_gguf(gguf_fields(header), path)
    chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]))
    text = sorted(TEXTS.glob("*.txt"))[0]
    held = tok.encode(text.read_text())[: args.tokens]
    print(f"chat prompt {len(chat)} tokens; {text.name}: {len(held)} tokens")
    ref_chat, ref_held = logits(ref.model, chat), logits(ref.model, held)
    ppl_ref = math.exp(nll(ref_held, held))
    top = ref_chat[-1].topk(2).indices
    margin = float(ref_chat[-1][top[0]] - ref_chat[-1][top[1]])
    print(f"ref ppl {ppl_ref:.4f}, chat top {tok.decode([int(ref_chat[-1].argmax())])!r}")
    with open(path, "rb") as f:
        srcs = gguf_sources(header, f, cfg, path)
        for v in args.variants:
            t = time.time()
            m = build(v, ref, auto, srcs)
            lc, lh = logits(m, chat), logits(m, held)
            d, dc = lh - ref_held, lc[-1] - ref_chat[-1]
            ppl = math.exp(nll(lh, held))
            agree = (lh.argmax(-1) == ref_held.argmax(-1)).float().mean().item()
            print(f"{v:24s} held max|dlogit| {d.abs().max():.3f} rms {d.pow(2).mean().sqrt():.4f}  chat-last max "
                  f"{dc.abs().max():.3f}  ppl {ppl:.4f} ({100 * (ppl / ppl_ref - 1):+.3f}%) argmax-agree {agree:.4f} "
                  f"chat top {tok.decode([int(lc[-1].argmax())])!r} margin_ref {margin:.3f} ({time.time() - t:.0f}s)",
                  flush=True)


if __name__ == "__main__":
    main()
