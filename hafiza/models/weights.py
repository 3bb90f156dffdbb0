"""Which format each weight takes (auto, q4, q8, bf16 or fp32) and building it one tensor at a time.

A `Source` reads row ranges of one tensor from wherever it lives (a GGUF file, a safetensors dict) as either
exact quantized integers (`GroupedInts`) or a dense tensor; nothing here ever holds more than one tensor's
transient at a time, so no fp32 copy of the whole model exists unless fp32 weights were asked for.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
from gguf import GGMLQuantizationType

from hafiza.errors import ConfigError
from hafiza.models import ggml_repack as kernels
from hafiza.models.ggml_blocks import GroupedInts
from hafiza.models.ggml_linear import GGMLLinear
from hafiza.models.linear import (
    INT4_GROUP,
    ConcatLinear,
    DenseLinear,
    DenseRows,
    GGUFRows,
    GroupedRows,
    Int4Linear,
    Int8Linear,
    Linear,
    RefinedHead,
    Rows,
    int4_block_rows,
    pack_int4_cpu_numpy,
)
from hafiza.models.weight_cache import WeightCache

WEIGHT_MODES = ("auto", "q4", "q8", "bf16", "fp32")
CHUNK_VALUES = 1 << 24  # rows are read and converted ~16M values at a time
ROW_ALIGN = 64  # chunks and jobs start at multiples of this: whole blocks of either CPU int4 layout (64 or 32 rows)
JOB_VALUES = 1 << 21  # the compiled repacking runs ~2M values per job, jobs spread over the allowed cores

_DENSE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_weights_mode(mode: str) -> str:
    """The mode, or one ConfigError line naming the choices."""
    if mode not in WEIGHT_MODES:
        raise ConfigError(f"unknown weight format {mode!r}: use {', '.join(WEIGHT_MODES)}", setting="weights")
    return mode


@dataclass
class Source:
    """One tensor in Hugging Face layout ([out, in] or [n]); `read(a, b)` gives rows a..b.

    `bits` is the stored integer width of a quantized tensor (4, 5, 6, 8; `group` its group width), or None
    for a dense one whose dtype is `dense_dtype`.
    """

    name: str
    shape: tuple[int, ...]
    read: Callable[[int, int], GroupedInts | torch.Tensor]
    bits: int | None = None
    group: int = 0
    dense_dtype: torch.dtype = torch.float32
    raw: Callable[[int, int], np.ndarray] | None = None  # a GGUF tensor's own block bytes for rows a..b
    qtype: GGMLQuantizationType | None = None
    fetch: Callable[[int, int], None] | None = None  # rows a..b are about to be read whole: map their pages
    drop: Callable[[int, int], None] | None = None  # rows a..b are repacked: their file pages may go

    @property
    def rows(self) -> int:
        return self.shape[0]

    def chunks(self) -> list[tuple[int, int]]:
        k = int(np.prod(self.shape[1:])) if len(self.shape) > 1 else 1
        step = max(ROW_ALIGN, (CHUNK_VALUES // max(k, 1)) // ROW_ALIGN * ROW_ALIGN)
        return [(a, min(a + step, self.rows)) for a in range(0, self.rows, step)]


def tensor_source(name: str, t: torch.Tensor) -> Source:
    """A Source over an in-memory tensor (safetensors, tests)."""
    return Source(name, tuple(t.shape), lambda a, b: t[a:b], dense_dtype=t.dtype)


def _as_fp32(part: GroupedInts | torch.Tensor) -> torch.Tensor:
    if isinstance(part, GroupedInts):
        return torch.from_numpy(part.dequantize())
    return part.float()


def linear_format(src: Source, mode: str) -> str:
    """int4 | int8 | fp32 | bf16 | fp16 for one matmul weight under `mode`."""
    n, k = src.shape
    int4_ok = n % 16 == 0 and k % INT4_GROUP == 0
    if mode == "fp32" or mode == "bf16":
        return mode
    if mode == "q8":
        return "int8"
    if mode == "q4":
        return "int4" if int4_ok else "int8"
    if src.bits is None:  # auto on a dense tensor keeps its dtype
        return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(src.dense_dtype, "fp32")
    if src.group == INT4_GROUP and int4_ok and src.bits in (4, 8):
        return "int4" if src.bits == 4 else "int4x2"
    return "int8"


def _compiled(srcs: list[Source]) -> bool:
    """Whether every part is a GGUF tensor of a type the compiled repacking reads (ggml_repack.py)."""
    return all(s.raw is not None and s.qtype in kernels.KERNEL_TYPES for s in srcs)


_POOL: list[ThreadPoolExecutor] = []


def _run_rows(srcs: list[Source], job: Callable[[Source, int, int, int], None]) -> None:
    """job(src, first output row, a, b) over row ranges of every source (multiples of ROW_ALIGN rows), on a thread per
    allowed core (the kernels release the GIL); each range's file pages are dropped once it is done."""
    from hafiza.threads import allowed_cpus

    def one(s: Source, row: int, a: int, b: int) -> None:
        if s.fetch is not None:
            s.fetch(a, b)
        job(s, row, a, b)
        if s.drop is not None:
            s.drop(a, b)

    tasks = []
    row = 0
    for s in srcs:
        step = max(ROW_ALIGN, JOB_VALUES // max(s.shape[1], 1) // ROW_ALIGN * ROW_ALIGN)
        tasks += [(s, row, a, min(a + step, s.rows)) for a in range(0, s.rows, step)]
        row += s.rows
    workers = min(len(allowed_cpus()), 8)
    if workers < 2 or len(tasks) < 2:
        for t in tasks:
            one(*t)
        return
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(workers, thread_name_prefix="hafiza-repack"))
    for f in [_POOL[0].submit(one, *t) for t in tasks]:
        f.result()


def _int4_compiled(srcs: list[Source], device: torch.device, planes: int,
                   cache: WeightCache | None = None) -> Int4Linear:
    """int4 (planes=1, 4-bit types) or two int4 planes (planes=2, Q8_0) straight from the file's blocks (or the
    cache's copy of them)."""
    n, k = sum(s.rows for s in srcs), srcs[0].shape[1] * planes
    entry = WeightCache.entry([s.name for s in srcs], f"int4x{planes}")
    size = n * k // 2
    stored = cache.read(entry, size + k // INT4_GROUP * n * 4) if cache is not None else None
    if stored is not None:
        sz = torch.from_numpy(stored[size:].view(np.int16)).view(torch.bfloat16).view(k // INT4_GROUP, n, 2)
        return Int4Linear(torch.from_numpy(stored[:size]).view(n, k // 2), sz, device, planes)
    block = int4_block_rows()
    assert block is not None
    packed = np.empty((n // block, k, block // 2), dtype=np.uint8)
    sz = torch.empty(k // INT4_GROUP, n, 2, dtype=torch.bfloat16)  # the kernel's [G, N, (scale, zero)]
    words, sz_bits = packed.view(np.uint64), sz.view(torch.int16).numpy().view(np.uint16)

    def job(s: Source, row: int, a: int, b: int) -> None:
        assert s.raw is not None and s.qtype is not None
        if planes == 1:
            kernels.int4_rows(s.raw(a, b), int(s.qtype), kernels.F16_TABLE, row + a, words, sz_bits)
        else:
            kernels.int4x2_rows(s.raw(a, b), kernels.F16_TABLE, row + a, words, sz_bits)

    _run_rows(srcs, job)
    if cache is not None:
        cache.write(entry, [packed, sz_bits])
    return Int4Linear(torch.from_numpy(packed.reshape(n, k // 2)), sz, device, planes)


def _int8_compiled(srcs: list[Source], device: torch.device, cache: WeightCache | None = None) -> Int8Linear:
    """int8 per output row straight from the file's blocks (or the cache's copy of them)."""
    n, k = sum(s.rows for s in srcs), srcs[0].shape[1]
    entry = WeightCache.entry([s.name for s in srcs], "int8")
    stored = cache.read(entry, n * k + 4 * n) if cache is not None else None
    if stored is not None:
        q_t = torch.from_numpy(stored[: n * k].view(np.int8)).view(n, k)
        return Int8Linear(q_t, torch.from_numpy(stored[n * k :].view(np.float32)), device)
    q = np.empty((n, k), dtype=np.int8)
    scale = np.empty(n, dtype=np.float32)

    def job(s: Source, row: int, a: int, b: int) -> None:
        assert s.raw is not None and s.qtype is not None
        kernels.int8_rows(s.raw(a, b), int(s.qtype), kernels.F16_TABLE, kernels.group_of(s.qtype),
                          q[row + a : row + b], scale[row + a : row + b])

    _run_rows(srcs, job)
    if cache is not None:
        cache.write(entry, [q, scale])
    return Int8Linear(torch.from_numpy(q), torch.from_numpy(scale), device)


def _fp32_part(s: Source, a: int, b: int) -> torch.Tensor:
    """Rows a..b of a source in fp32, exactly gguf's values (compiled for the GGUF types it reads)."""
    if not _compiled([s]):
        return _as_fp32(s.read(a, b))
    assert s.raw is not None and s.qtype is not None
    out = np.empty((b - a, s.shape[1]), dtype=np.float32)
    kernels.dequant_rows(s.raw(a, b), int(s.qtype), kernels.F16_TABLE, kernels.group_of(s.qtype), out)
    return torch.from_numpy(out)


def _dense(srcs: list[Source], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    n, k = sum(s.rows for s in srcs), srcs[0].shape[1]
    out = torch.empty(n, k, dtype=dtype, device=device)
    row = 0
    for s in srcs:
        for a, b in s.chunks():
            out[row + a : row + b] = _fp32_part(s, a, b).to(dtype) if not _keeps(s, dtype) else s.read(a, b)
        row += s.rows
    return out


def _keeps(s: Source, dtype: torch.dtype) -> bool:
    return s.bits is None and s.dense_dtype == dtype


def _int8(srcs: list[Source], device: torch.device, cache: WeightCache | None = None) -> Int8Linear:
    if _compiled(srcs):
        return _int8_compiled(srcs, device, cache)
    n, k = sum(s.rows for s in srcs), srcs[0].shape[1]
    q = torch.empty(n, k, dtype=torch.int8)
    scale = torch.empty(n, dtype=torch.float32)
    row = 0
    for s in srcs:
        for a, b in s.chunks():
            w = _as_fp32(s.read(a, b))
            sc = w.abs().amax(dim=1).clamp_min(1e-30) / 127.0
            q[row + a : row + b] = torch.round(w / sc[:, None]).clamp_(-127, 127).to(torch.int8)
            scale[row + a : row + b] = sc
        row += s.rows
    return Int8Linear(q, scale, device)


def requantize_int4(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """fp32 [N, K] -> asymmetric int4 per 32 values: q = round((w - min) / s), s = (max - min) / 15, so
    w ~ (q - 8) * s + (min + 8 s); returns (q, s, min + 8 s)."""
    n, k = w.shape
    g = w.view(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    s = (hi - lo) / 15.0
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    q = torch.round((g - lo[..., None]) * inv[..., None]).clamp_(0, 15).to(torch.uint8).view(n, k)
    return q.numpy(), s.numpy(), (lo + 8.0 * s).numpy()


def _int4_parts(part: GroupedInts | torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q, scale, zero) of int4 for one chunk: 4-bit 32-wide blocks as they are, anything else requantized."""
    if isinstance(part, GroupedInts) and part.bits == 4 and part.group == INT4_GROUP:
        return part.q, part.scale, part.zero + np.float32(8) * part.scale
    return requantize_int4(_as_fp32(part))


def two_plane_parts(part: GroupedInts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An up-to-8-bit 32-wide grouped tensor as two int4 planes [hi | lo] (q [rows, 2K], scale/zero per 32):
    with u = q (+128 if signed), w = (hi' - 8) * 16 s + (lo - 8) * s + c, hi' = u >> 4 (+8 below 8 bits, so the
    plane's values stay in 0..15 and c stays near 8 s), lo = u & 15, c = zero + s * (136 - offset - 16 * shift).
    Exact in fp32; the kernel rounds s and c to bf16 (16 s stays 16 times bf16(s))."""
    signed = part.q.dtype == np.int8
    u = (part.q.astype(np.int16) + 128).astype(np.uint8) if signed else part.q
    shift = 0 if part.bits == 8 else 8
    hi, lo = (u >> 4) + np.uint8(shift), u & np.uint8(15)
    s = part.scale
    c = part.zero + s * np.float32(136 - (128 if signed else 0) - 16 * shift)
    return (np.concatenate([hi, lo], axis=1), np.concatenate([16 * s, s], axis=1),
            np.concatenate([np.zeros_like(s), c], axis=1))


def _int4x2_parts(part: GroupedInts | torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if not isinstance(part, GroupedInts) or part.group != INT4_GROUP or part.bits > 8:
        raise ValueError("two int4 planes hold only 32-wide grouped integers of up to 8 bits")
    return two_plane_parts(part)


def _int4(srcs: list[Source], device: torch.device, planes: int = 1, cache: WeightCache | None = None) -> Int4Linear:
    """int4 group-wise from 4-bit sources (planes=1) or 8-bit ones as two exact planes (planes=2)."""
    parts_of = _int4_parts if planes == 1 else _int4x2_parts
    n, k = sum(s.rows for s in srcs), srcs[0].shape[1] * planes
    block = int4_block_rows() if device.type == "cpu" else None
    cpu_layout = block is not None and all(s.rows % block == 0 for s in srcs)
    types = kernels.INT4_TYPES if planes == 1 else {GGMLQuantizationType.Q8_0}
    if cpu_layout and _compiled(srcs) and all(s.qtype in types for s in srcs):
        return _int4_compiled(srcs, device, planes, cache)
    if cpu_layout:
        # chunk by chunk straight into the kernel's layout: no whole-tensor integer copy
        packed = np.empty((n, k // 2), dtype=np.uint8)
        sz = torch.empty(k // INT4_GROUP, n, 2, dtype=torch.bfloat16)
        row = 0
        for s in srcs:
            for a, b in s.chunks():
                q, scale, zero = parts_of(s.read(a, b))
                packed[row + a : row + b] = pack_int4_cpu_numpy(q, block)
                sz[:, row + a : row + b, 0] = torch.from_numpy(scale).t()
                sz[:, row + a : row + b, 1] = torch.from_numpy(zero).t()
            row += s.rows
        return Int4Linear(torch.from_numpy(packed), sz, device, planes)
    q = np.empty((n, k), dtype=np.uint8)
    scale = np.empty((n, k // INT4_GROUP), dtype=np.float32)
    zero = np.empty_like(scale)
    row = 0
    for s in srcs:
        for a, b in s.chunks():
            r = slice(row + a, row + b)
            q[r], scale[r], zero[r] = parts_of(s.read(a, b))
        row += s.rows
    return Int4Linear.from_ints(q, scale, zero, device, planes)


def _ggml_ready(srcs: list[Source], mode: str, device: torch.device) -> bool:
    """Whether `auto` runs these GGUF tensors through ggml's kernels as they are (kernel_choice.py)."""
    from hafiza.models.ggml_linear import GGML_TYPES
    from hafiza.models.kernel_choice import cpu_kernel

    return (mode == "auto" and device.type == "cpu" and all(s.raw is not None and s.qtype in GGML_TYPES
                                                            for s in srcs) and cpu_kernel() == "ggml")


def _ggml(srcs: list[Source]) -> Linear:
    """The file's blocks under ggml's kernel: one tensor stays a view of the mapped file; a fused group of one type
    is copied into one block array (then its file pages are dropped), a group of mixed types stays in parts."""
    from hafiza.models.ggml_linear import GGMLLinear

    k = srcs[0].shape[1]
    if len({s.qtype for s in srcs}) > 1:
        return ConcatLinear([_ggml([s]) for s in srcs])
    qtype = srcs[0].qtype
    assert qtype is not None
    if len(srcs) == 1:
        assert srcs[0].raw is not None
        return GGMLLinear(srcs[0].raw(0, srcs[0].rows), qtype, k)
    parts = []
    for s in srcs:
        assert s.raw is not None
        if s.fetch is not None:
            s.fetch(0, s.rows)
        parts.append(np.array(s.raw(0, s.rows)))
        if s.drop is not None:
            s.drop(0, s.rows)
    return GGMLLinear(np.concatenate(parts), qtype, k)


def build_linear(srcs: list[Source], mode: str, device: torch.device, cache: WeightCache | None = None) -> Linear:
    """One matmul over the row-concatenation of `srcs` (fused q/k/v or gate/up); parts whose formats differ
    are built separately and their outputs concatenated. `cache`: where compiled repackings are kept."""
    if _ggml_ready(srcs, mode, device):
        return _ggml(srcs)
    formats = [linear_format(s, mode) for s in srcs]
    if len(set(formats)) > 1:
        return ConcatLinear([build_linear([s], mode, device, cache) for s in srcs])
    fmt = formats[0]
    if fmt in ("int4", "int4x2"):
        return _int4(srcs, device, 1 if fmt == "int4" else 2, cache)
    if fmt == "int8":
        return _int8(srcs, device, cache)
    return DenseLinear(_dense(srcs, _DENSE[fmt], device))


def build_rows(src: Source, mode: str, dtype: torch.dtype, device: torch.device) -> Rows:
    """The embedding table: dense under fp32/bf16 (or auto on a dense tensor), else int8 rows with a scale and
    zero per group (exactly gguf's values for a quantized tensor; per 32 values, symmetric, for a dense one)."""
    if mode in ("fp32", "bf16") or (mode == "auto" and src.bits is None):
        fmt = mode if mode != "auto" else linear_format(src, "auto")
        return DenseRows(_dense([src], _DENSE[fmt], device), dtype)
    v, k = src.shape
    if device.type == "cpu" and src.raw is not None and src.qtype is not None:
        return GGUFRows(src.raw(0, v), src.qtype, k, dtype)  # the mapped file's blocks, as llama.cpp keeps them
    first = src.read(0, min(16, v))
    group = first.group if isinstance(first, GroupedInts) else INT4_GROUP
    q = np.empty((v, k), dtype=np.int8)
    scale = np.empty((v, k // group), dtype=np.float32)
    zero = np.zeros_like(scale)
    for a, b in src.chunks():
        part = src.read(a, b)
        if isinstance(part, GroupedInts):
            q[a:b], scale[a:b], zero[a:b] = part.q.view(np.int8) if part.q.dtype == np.int8 else part.q, \
                part.scale, part.zero
        else:
            w = part.float().view(b - a, k // group, group)
            sc = w.abs().amax(dim=-1).clamp_min(1e-30) / 127.0
            q[a:b] = torch.round(w / sc[..., None]).clamp_(-127, 127).to(torch.int8).view(b - a, k).numpy()
            scale[a:b] = sc.numpy()
    return GroupedRows(q, scale, zero, group, dtype, device)


@dataclass
class LayerWeights:
    """One decoder layer with q/k/v and gate/up fused so each is a single matmul."""

    input_norm: torch.Tensor
    qkv: Linear
    qkv_bias: torch.Tensor | None
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


@dataclass
class ModelWeights:
    """Every weight of a Llama-family model in its run-time format."""

    embed: Rows
    norm: torch.Tensor
    lm_head: Linear
    layers: list[LayerWeights]
    rope_freqs: torch.Tensor | None = None
    mode: str = "fp32"
    extra: dict[str, int] = field(default_factory=dict)

    def linears(self) -> list[Linear]:
        out = [self.lm_head]
        for lw in self.layers:
            out += [lw.qkv, lw.o, lw.gate_up, lw.down]
        return out

    def formats(self) -> dict[str, int]:
        """Bytes of weights per format (the embedding under its own kind), for reports and benchmarks."""
        c: Counter[str] = Counter()
        c[self.embed.kind] += self.embed.nbytes
        for lin in self.linears():
            shared = isinstance(lin, DenseLinear) and isinstance(self.embed, DenseRows) and lin.w is self.embed.w
            if not shared:
                c[lin.kind] += lin.nbytes
        return dict(c)


def _trim_heap() -> None:
    """Hand freed heap memory back to the OS (glibc's malloc_trim): each tensor's transients are freed, but glibc
    keeps them mapped, and they would otherwise add up to a third of a 3B model's size in RSS."""
    if _LIBC:
        _LIBC[0].malloc_trim(0)


def _load_libc() -> list[ctypes.CDLL]:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return [libc]
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return []


_LIBC = _load_libc()


def _vector(src: Source, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _as_fp32(src.read(0, src.rows)).reshape(-1).to(device=device, dtype=dtype)


def build_model_weights(sources: dict[str, Source], num_layers: int, tie_embeddings: bool, mode: str,
                        dtype: torch.dtype, device: torch.device, cache: WeightCache | None = None) -> ModelWeights:
    """All layers from Hugging Face-named sources, one tensor (or one fused group) at a time; `cache` keeps
    (and gives back) the compiled repackings (weight_cache.py)."""
    from hafiza.errors import ModelLoadError

    check_weights_mode(mode)

    def src(name: str) -> Source:
        if name not in sources:
            raise ModelLoadError(f"model weights lack tensor {name!r}")
        return sources[name]

    embed_src = src("model.embed_tokens.weight")
    embed = build_rows(embed_src, mode, dtype, device)
    head_src = embed_src if tie_embeddings else src("lm_head.weight")
    if isinstance(embed, DenseRows) and tie_embeddings:
        lm_head: Linear = DenseLinear(embed.w)
    else:
        lm_head = build_linear([head_src], mode, device, cache)
        exact_rows = isinstance(embed, GGUFRows | GroupedRows) and embed_src.bits is not None  # gguf's values
        if tie_embeddings and exact_rows and isinstance(lm_head, Int4Linear | Int8Linear | GGMLLinear):
            lm_head = RefinedHead(lm_head, embed)
    layers = []
    for i in range(num_layers):
        p = f"model.layers.{i}."
        qkv = [src(p + f"self_attn.{x}_proj.weight") for x in "qkv"]
        bias = None
        if p + "self_attn.q_proj.bias" in sources:
            bias = torch.cat([_vector(src(p + f"self_attn.{x}_proj.bias"), dtype, device) for x in "qkv"])
        layers.append(LayerWeights(
            input_norm=_vector(src(p + "input_layernorm.weight"), dtype, device),
            qkv=build_linear(qkv, mode, device, cache),
            qkv_bias=bias,
            o=build_linear([src(p + "self_attn.o_proj.weight")], mode, device, cache),
            post_norm=_vector(src(p + "post_attention_layernorm.weight"), dtype, device),
            gate_up=build_linear([src(p + "mlp.gate_proj.weight"), src(p + "mlp.up_proj.weight")], mode, device,
                                 cache),
            down=build_linear([src(p + "mlp.down_proj.weight")], mode, device, cache),
        ))
        _trim_heap()
    rope = _vector(sources["rope_freqs"], torch.float32, device) if "rope_freqs" in sources else None
    return ModelWeights(embed, _vector(src("model.norm.weight"), dtype, device), lm_head, layers, rope, mode)
