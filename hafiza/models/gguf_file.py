"""Read a GGUF file: metadata to ModelConfig, tensors as lazy row Sources in Hugging Face names and layout."""

from __future__ import annotations

import contextlib
import mmap
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from hafiza.errors import ModelLoadError
from hafiza.models.config import ModelConfig
from hafiza.models.ggml_blocks import BLOCK, SUPPORTED, unpack_rows
from hafiza.models.gguf_header import GGUFHeader, TensorInfo, read_header
from hafiza.models.weights import Source

GGUF_ARCHES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def open_gguf(path: Path) -> GGUFHeader:
    """Parse the header; any malformed or truncated file becomes one ModelLoadError line."""
    return read_header(path)


def gguf_fields(header: GGUFHeader) -> dict[str, Any]:
    """All metadata key/values as plain Python values."""
    return header.fields


def config_from_gguf(fields: dict[str, Any], path: Path) -> ModelConfig:
    """Translate llama.cpp metadata keys to a ModelConfig."""
    arch_key = fields.get("general.architecture")
    if arch_key not in GGUF_ARCHES:
        raise ModelLoadError(
            f"{path}: unsupported architecture {arch_key!r}: hafiza runs llama, mistral and qwen2 GGUF files"
        )

    def get(name: str, default: Any = None) -> Any:
        return fields.get(f"{arch_key}.{name}", default)

    try:
        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        kv_heads = get("attention.head_count_kv", heads)
        tokens = fields.get("tokenizer.ggml.tokens") or []
        scaling = None
        if get("rope.scaling.type") == "linear":
            scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
        eos = fields.get("tokenizer.ggml.eos_token_id")
        return ModelConfig(
            arch=GGUF_ARCHES[arch_key],
            vocab_size=int(get("vocab_size", len(tokens))),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=int(get("attention.key_length", hidden // heads)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(get("context_length", 2048)),
            attention_bias=arch_key == "qwen2",
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[int(eos)] if eos is not None else [],
            name=str(fields.get("general.name", path.stem)),
        )
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: GGUF metadata incomplete or malformed ({exc})") from exc


def _unpermute_rows(rows: int, n_head: int) -> np.ndarray:
    """Source row of each output row that undoes llama.cpp's rotary permutation of q/k, so the weights match
    Hugging Face's rotate-half RoPE."""
    return np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(rows)


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    if gguf_name == "rope_freqs.weight":
        return "rope_freqs"
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


_DENSE_TYPES = {GGMLQuantizationType.F32: (np.float32, torch.float32),
                GGMLQuantizationType.F16: (np.float16, torch.float16),
                GGMLQuantizationType.BF16: (np.int16, torch.bfloat16)}


MADV_POPULATE_READ = 22  # Linux 5.14+: map a range's pages in one call instead of one fault per page


def _populate(pages: mmap.mmap, start: int, end: int) -> None:
    """Map the file pages of bytes start..end ahead of their first read (a no-op where the kernel lacks it)."""
    start -= start % mmap.PAGESIZE
    with contextlib.suppress(OSError):
        pages.madvise(MADV_POPULATE_READ, start, end - start)


def _tensor_source(data: np.ndarray, pages: mmap.mmap, t: TensorInfo, name: str, shape: tuple[int, ...],
                   perm: np.ndarray | None) -> Source:
    """Rows of one tensor as read-only views of the file's memory map (a copy only where q/k rows are permuted);
    `fetch` maps a row range's pages in one call before it is repacked and `drop` hands them back after, so the
    map never adds a model's size to the RSS."""
    qtype = GGMLQuantizationType(int(t.tensor_type))
    rows = shape[0]
    k = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    row_bytes = int(t.n_bytes) // rows
    offset = int(t.data_offset)

    def span(a: int, b: int) -> tuple[int, int]:
        return (a, b) if perm is None else (int(perm[a:b].min()), int(perm[a:b].max()) + 1)

    def raw(a: int, b: int) -> np.ndarray:
        lo, hi = span(a, b)
        arr = data[offset + lo * row_bytes : offset + hi * row_bytes].reshape(hi - lo, row_bytes)
        if perm is None:
            return arr
        arr = arr[perm[a:b] - lo]
        arr.flags.writeable = False  # one compiled form for views and copies alike
        return arr

    def fetch(a: int, b: int) -> None:
        lo, hi = span(a, b)
        _populate(pages, offset + lo * row_bytes, offset + hi * row_bytes)

    def drop(a: int, b: int) -> None:
        lo, hi = span(a, b)
        start, end = offset + lo * row_bytes, offset + hi * row_bytes
        start += -start % mmap.PAGESIZE
        end -= end % mmap.PAGESIZE
        if end > start:
            pages.madvise(mmap.MADV_DONTNEED, start, end - start)

    if qtype in SUPPORTED:
        return Source(name, shape, lambda a, b: unpack_rows(raw(a, b), qtype, k), bits=BLOCK[qtype][2],
                      group=BLOCK[qtype][3], raw=raw, qtype=qtype, fetch=fetch, drop=drop)
    if qtype in _DENSE_TYPES:
        np_dtype, torch_dtype = _DENSE_TYPES[qtype]

        def dense(a: int, b: int) -> torch.Tensor:
            arr = raw(a, b).view(np_dtype).reshape((b - a, *shape[1:]))
            return torch.from_numpy(arr.copy()).view(torch_dtype)

        return Source(name, shape, dense, dense_dtype=torch_dtype, drop=drop)

    def other(a: int, b: int) -> torch.Tensor:  # a quantized type without its own unpacker: gguf's numbers
        return torch.from_numpy(dequantize(raw(a, b), qtype).reshape(b - a, *shape[1:]))

    return Source(name, shape, other, bits=8, drop=drop)


def gguf_sources(header: GGUFHeader, f: BinaryIO, config: ModelConfig, path: Path) -> dict[str, Source]:
    """Every tensor hafiza uses, in Hugging Face names and [out, in] layout, read lazily from the file's memory map
    (which stays open as long as a Source does)."""
    sources: dict[str, Source] = {}
    permuted = config.arch in ("llama", "mistral")
    try:
        pages = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot map the file ({exc})") from exc
    size = len(pages)
    data = np.frombuffer(pages, dtype=np.uint8)
    for t in header.tensors:
        name = _hf_name(t.name)
        if name is None:
            continue
        shape = t.shape
        if t.data_offset + t.n_bytes > size:
            raise ModelLoadError(f"{path}: tensor {t.name} is truncated ({t.n_bytes} bytes at {t.data_offset} "
                                 f"of a {size}-byte file)")
        perm = None
        if permuted and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            perm = _unpermute_rows(shape[0], config.num_heads)
        elif permuted and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            perm = _unpermute_rows(shape[0], config.num_kv_heads)
        sources[name] = _tensor_source(data, pages, t, name, shape, perm)
    if "lm_head.weight" not in sources:
        config.tie_word_embeddings = True
    if "rope_freqs" in sources:
        config.rope_scaling = {"rope_type": "freq_factors"}
    return sources
