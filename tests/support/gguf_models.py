"""Synthetic GGUF files: random blocks of any supported tensor type, written with the `gguf` package's writer.

Blocks are random bytes with their fp16 scale fields set to small sane values, so every type (K-quants too, which
gguf cannot quantize) is exercised; the tokenizer metadata is copied from the default model so files load fully.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES

# byte offsets of the fp16 scale fields inside one block, per type
_SCALE_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.Q4_K: [0, 2],
                 T.Q5_K: [0, 2], T.Q6_K: [208]}
_SCALE = {T.Q4_K: 0.002, T.Q5_K: 0.002, T.Q6_K: 0.0005}


def random_blocks(rows: int, k: int, qtype: T, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes per row] of random blocks whose dequantized values are ~N(0, 0.05)-sized."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * k // block, size), dtype=np.uint8)
    for off in _SCALE_FIELDS[qtype]:
        d = rng.uniform(0.5, 1.5, size=raw.shape[0]) * _SCALE.get(qtype, 0.006)
        if qtype in (T.Q4_1, T.Q5_1) and off == 2:
            d = -d * 8
        raw[:, off : off + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def dense_tensor(rows: int, k: int, qtype: T, rng: np.random.Generator) -> np.ndarray:
    """A random F32 / F16 / BF16 tensor [rows, k] (BF16 as its raw int16 bits, as gguf stores it)."""
    w = (rng.standard_normal((rows, k)) * 0.05).astype(np.float32)
    if qtype == T.F16:
        return w.astype(np.float16)
    if qtype == T.BF16:
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)
    return w


@dataclass
class Shape:
    """A Llama-family model's sizes."""

    hidden: int = 64
    inter: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    context: int = 2048


def _tokenizer_fields(source: Path) -> dict[str, object]:
    r = GGUFReader(str(source), "r")
    out = {}
    for key, field in r.fields.items():
        if key.startswith("tokenizer."):
            out[key] = field.contents()
    return out


def write_model(path: Path, tokenizer_source: Path, types: dict[str, T], shape: Shape = Shape(),
                arch: str = "llama", tied: bool = True, seed: int = 0, reuse: bool = False) -> Path:
    """A GGUF model whose tensor types come from `types` (keys: 'embed', 'attn_q', ..., 'output', or 'default').

    `reuse` writes the same random block array for every tensor of one shape and type (large files in seconds).
    """
    rng = np.random.default_rng(seed)
    tok = _tokenizer_fields(tokenizer_source)
    vocab = len(tok["tokenizer.ggml.tokens"])  # type: ignore[arg-type]
    head_dim = shape.hidden // shape.heads
    w = GGUFWriter(str(path), arch)
    w.add_name(f"synthetic-{arch}")
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.inter)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    for key, value in tok.items():
        if key == "tokenizer.ggml.model":
            w.add_tokenizer_model(str(value))
        elif key == "tokenizer.ggml.tokens":
            w.add_token_list(value)  # type: ignore[arg-type]
        elif key == "tokenizer.ggml.merges":
            w.add_token_merges(value)  # type: ignore[arg-type]
        elif key == "tokenizer.ggml.token_type":
            w.add_token_types(value)  # type: ignore[arg-type]
        elif key.endswith("_token_id"):
            w.add_uint32(key, int(value))  # type: ignore[call-overload]
        elif key == "tokenizer.chat_template":
            w.add_chat_template(str(value))
        elif key == "tokenizer.ggml.pre":
            w.add_tokenizer_pre(str(value))
    cache: dict[tuple[int, int, T], np.ndarray] = {}

    def tensor(name: str, kind: str, rows: int, k: int) -> None:
        qtype = types.get(kind, types.get("default", T.Q8_0))
        key = (rows, k, qtype)
        if reuse and key in cache:
            arr = cache[key]
        elif qtype in (T.F32, T.F16, T.BF16):
            arr = dense_tensor(rows, k, qtype, rng)
        else:
            arr = random_blocks(rows, k, qtype, rng)
        if reuse:
            cache[key] = arr
        if qtype == T.BF16:
            w.add_tensor(name, arr, raw_shape=(rows, k), raw_dtype=T.BF16)
        elif qtype in (T.F32, T.F16):
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_dtype=qtype)

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    tensor("token_embd.weight", "embed", vocab, shape.hidden)
    norm("output_norm.weight", shape.hidden)
    if not tied:
        tensor("output.weight", "output", vocab, shape.hidden)
    kv = shape.kv_heads * head_dim
    for i in range(shape.layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", shape.hidden)
        norm(p + "ffn_norm.weight", shape.hidden)
        tensor(p + "attn_q.weight", "attn_q", shape.hidden, shape.hidden)
        tensor(p + "attn_k.weight", "attn_k", kv, shape.hidden)
        tensor(p + "attn_v.weight", "attn_v", kv, shape.hidden)
        tensor(p + "attn_output.weight", "attn_output", shape.hidden, shape.hidden)
        tensor(p + "ffn_gate.weight", "ffn_gate", shape.inter, shape.hidden)
        tensor(p + "ffn_up.weight", "ffn_up", shape.inter, shape.hidden)
        tensor(p + "ffn_down.weight", "ffn_down", shape.hidden, shape.inter)
        if arch == "qwen2":
            for x, n in (("q", shape.hidden), ("k", kv), ("v", kv)):
                w.add_tensor(p + f"attn_{x}.bias", (0.1 * rng.standard_normal(n)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
