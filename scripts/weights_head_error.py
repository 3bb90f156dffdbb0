"""The default model's tied head (Q8_0) in other formats: perplexity change and rms logits error against the exact
fp32 head, on the exact fp32 model's hidden states of each quality text.

Each variant is emulated in fp32 (int8 per channel with a max or an MSE-optimal scale, bf16, Q8_0 with bf16 d, the
exact weights with bf16 activations and output), so only the head's own rounding is measured (docs/WEIGHTS.md).
Usage: python scripts/weights_head_error.py [--variants V ...] [--tokens N] [--threads T]
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from hafiza.cache.pool import layout_for, make_kv_pool
from hafiza.models import load_model
from hafiza.models.attention import AttentionMetadata, PrefillSpan
from hafiza.models.gguf_file import config_from_gguf, gguf_fields, gguf_sources, open_gguf
from hafiza.models.llama import LlamaModel
from hafiza.models.loader import default_model_path

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ROOT / "bench" / "texts" / "quality"
Head = Callable[[torch.Tensor], torch.Tensor]


def bf(t: torch.Tensor) -> torch.Tensor:
    """Values rounded to bf16 and back to fp32."""
    return t.bfloat16().float()


def hidden(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """The model's final-normed hidden states of `ids`, one prefill into a fresh fp32 pool."""
    n = len(ids)
    pool = make_kv_pool(layout_for(model.config, n // 16 + 2, 16, "fp32", torch.float32), "cpu")
    meta = AttentionMetadata(slot_mapping=torch.arange(n), prefills=[PrefillSpan(0, n, n)])
    with torch.inference_mode():
        return model.forward(torch.tensor(ids), torch.arange(n), meta, pool)


def ppl(logits: torch.Tensor, ids: list[int]) -> float:
    """Perplexity of ids[1:] under the logits of ids[:-1]."""
    lp = torch.log_softmax(logits[:-1].float(), -1)
    return math.exp(-lp.gather(1, torch.tensor(ids[1:])[:, None]).mean().item())


def quantize(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 values of w [V, K] under one scale per row."""
    return torch.round(w / s[:, None]).clamp(-127, 127)


def mse_scale(w: torch.Tensor, s_max: torch.Tensor) -> torch.Tensor:
    """Per row, the scale among 0.6..1.0 x the max scale (17 steps) with the least squared int8 error."""
    best = s_max.clone()
    best_e = ((quantize(w, best) * best[:, None] - w) ** 2).sum(1)
    for f in np.linspace(0.6, 1.0, 17):
        s = s_max * f
        e = ((quantize(w, s) * s[:, None] - w) ** 2).sum(1)
        m = e < best_e
        best[m] = s[m]
        best_e[m] = e[m]
    return best


def heads(q: torch.Tensor, d: torch.Tensor) -> dict[str, Head]:
    """Every head variant from Q8_0's q [V, K] and d [V, K / 32]: hidden [T, K] -> logits [T, V]."""
    v, k = q.shape
    w = (q.view(v, -1, 32) * d[..., None]).view(v, k)
    s_max = w.abs().amax(1) / 127
    q8 = quantize(w, s_max)
    s_mse = mse_scale(w, s_max)
    q8m = quantize(w, s_mse)
    w_bf16d = (q.view(v, -1, 32) * bf(d)[..., None]).view(v, k)
    return {
        "exact": lambda h: h @ w.t(),
        "int8_bf16act": lambda h: bf(bf(h) @ (q8 * bf(s_max)[:, None]).t()),
        "int8_fp32act": lambda h: h @ (q8 * s_max[:, None]).t(),
        "int8_mse_bf16act": lambda h: bf(bf(h) @ (q8m * bf(s_mse)[:, None]).t()),
        "bf16_dense": lambda h: bf(bf(h) @ bf(w).t()),
        "q8_0_bf16d_bf16io": lambda h: bf(bf(h) @ w_bf16d.t()),
        "exact_bf16io": lambda h: bf(bf(h) @ w.t()),
    }


VARIANTS = ("exact", "int8_bf16act", "int8_fp32act", "int8_mse_bf16act", "bf16_dense", "q8_0_bf16d_bf16io",
            "exact_bf16io")


def main() -> None:
    """Print one line per head variant: per text, ppl change and rms logits error against the exact head."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--tokens", type=int, default=1024, help="tokens of each quality text (default 1024)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = default_model_path()
    ref = load_model(path, weights="fp32", device="cpu")
    tok = ref.tokenizer
    texts = sorted(TEXTS.glob("*.txt"))
    header = open_gguf(path)
    cfg = config_from_gguf(gguf_fields(header), path)
    with open(path, "rb") as f:
        src = gguf_sources(header, f, cfg, path)["model.embed_tokens.weight"]
        g = src.read(0, src.rows)
    variants = heads(torch.from_numpy(g.q.astype(np.float32)), torch.from_numpy(g.scale))
    ids = [tok.encode(t.read_text())[: args.tokens] for t in texts]
    hs = [hidden(ref.model, i) for i in ids]
    refs = [variants["exact"](h) for h in hs]
    print("texts", [t.name for t in texts])
    for name in args.variants:
        out = []
        for h, i, r in zip(hs, ids, refs, strict=True):
            logits = variants[name](h)
            out.append(f"{100 * (ppl(logits, i) / ppl(r, i) - 1):+.3f}% rms {(logits - r).pow(2).mean().sqrt():.4f}")
        print(f"{name:20s}", " | ".join(out), flush=True)


if __name__ == "__main__":
    main()
