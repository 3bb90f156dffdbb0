"""Weight formats for the model's matmuls and its embedding table, each one torch kernel on CPU and CUDA.

- `Int4Linear`: int4 group-wise (32 wide, bf16 scale + zero, w = (q - 8) * scale + zero), torch's packed
  weight-only kernel (`_weight_int4pack_mm_for_cpu` on the CPU, `_weight_int4pack_mm` on CUDA).
- `Int8Linear`: int8 per output channel (bf16 scale), `_weight_int8pack_mm`.
- `DenseLinear`: fp32 / bf16 / fp16 weights, `F.linear`.
- `GGUFRows` (CPU) / `GroupedRows`: an embedding table as the file's own blocks, unpacked per looked-up row, or
  as int8 with an fp32 scale + zero per group; both give gguf's own values.

Contract: row i of every output depends only on row i of the input, bit for bit, whatever the number of rows
(tests/models/test_linear_formats.py). The packed kernels keep it as they are; measurements: docs/WEIGHTS.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from hafiza.models.ggml_blocks import unpack_rows
from hafiza.threads import decode_parts

INT4_GROUP = 32
ROW_TILE = 16  # rows per CPU float matmul call: whole tiles run the same BLAS kernel whatever the row count


class Linear(Protocol):
    """x [M, in] in the compute dtype -> [M, out] in the same dtype."""

    kind: str
    out_features: int
    in_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def dense(self) -> torch.Tensor: ...

    @property
    def nbytes(self) -> int: ...


Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def in_row_tiles(x: torch.Tensor, w: torch.Tensor, matmul: Matmul) -> torch.Tensor:
    """matmul(x, w) run on zero-padded tiles of exactly ROW_TILE rows, one call per tile, so row i of the output
    depends only on row i of x, bit for bit. MKL and oneDNN pick their kernel (and its rounding) by the row
    count and the thread split, below 16 rows on one CPU, below 4 on another; a fixed tile shape runs one kernel
    for every row (tests/models/test_linear_formats.py, test_linear_invariance.py)."""
    rows = x.shape[0]
    pad = -rows % ROW_TILE
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    if x.shape[0] == ROW_TILE:
        return matmul(x, w)[:rows]
    return torch.cat([matmul(tile, w) for tile in x.split(ROW_TILE)])[:rows]


def _sliced_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One tile times w with w's output rows split into decode_parts() slices run as one batched matmul: MKL runs
    F.linear's matrix-vector form on one thread only, and the slices stream the weight up to 1.6x faster."""
    (out_features, in_features), rows = w.shape, x.shape[0]
    parts = decode_parts()
    if parts < 1 or out_features % parts:
        parts = 1
    slices = w.view(parts, out_features // parts, in_features).transpose(1, 2)
    return torch.bmm(x.unsqueeze(0).expand(parts, rows, in_features), slices).transpose(0, 1).reshape(rows, -1)


def cpu_fp32_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T for fp32 on the CPU, row-invariant (in_row_tiles) with the decode slices fixed for the process, so
    a token's values do not depend on its batch-mates (tests/models/test_linear_invariance.py)."""
    out = in_row_tiles(x, w, _sliced_fp32)
    return out if bias is None else out + bias


class DenseLinear:
    """A plain weight [out, in] in fp32, bf16 or fp16; the input is cast to the weight's dtype and back. On the
    CPU the product runs in whole row tiles (fp32 through cpu_fp32_linear), so every row is batch-invariant."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w = w.contiguous()
        self.out_features, self.in_features = w.shape
        self.kind = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[w.dtype]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xw = x if x.dtype == self.w.dtype else x.to(self.w.dtype)
        if x.device.type != "cpu":
            y = F.linear(xw, self.w)
        elif self.w.dtype == torch.float32:
            y = cpu_fp32_linear(xw, self.w)
        else:
            y = in_row_tiles(xw, self.w, F.linear)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def dense(self) -> torch.Tensor:
        return self.w.float()

    @property
    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size()


def pack_int4_cpu_numpy(q: np.ndarray, block: int) -> np.ndarray:
    """The CPU kernel's layout written directly: blocks of `block` output rows (64 under AVX-512, 32 under AVX2),
    for each input k block / 2 bytes holding rows j (low nibble) and j + block / 2 (high nibble); a last partial
    block holds rows 2i and 2i + 1 in byte i, as torch's packer writes it."""
    n, k = q.shape
    full = n - n % block
    v = q[:full].reshape(full // block, 2, block // 2, k)
    out = np.empty((n, k // 2), dtype=np.uint8)
    out[:full] = np.ascontiguousarray((v[:, 0] | (v[:, 1] << 4)).transpose(0, 2, 1)).reshape(full, k // 2)
    if full < n:
        tail = q[full:]
        out[full:] = np.ascontiguousarray((tail[0::2] | (tail[1::2] << 4)).T).reshape(n - full, k // 2)
    return out


def _pack_int4_cpu_torch(q: np.ndarray) -> torch.Tensor:
    """torch's own packing, 4096 rows at a time (the layout is row-blocked, so chunks concatenate; tested) to
    bound the int32 transient."""
    n, k = q.shape
    out = torch.empty(n, k // 2, dtype=torch.uint8)
    for a in range(0, n, 4096):
        chunk = torch.from_numpy(q[a : a + 4096].astype(np.int32))
        out[a : a + 4096] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(chunk, 1)
    return out


_BLOCK_ROWS: list[int | None] = []


def int4_block_rows() -> int | None:
    """Rows per block of the int4 layout that this process's CPU kernel reads: 64 under AVX-512, 32 under AVX2
    (torch picks by `ATEN_CPU_CAPABILITY` and the CPU), found by packing a 160 x 96 probe with torch itself; None
    if neither layout matches (then every int4 weight is packed by torch)."""
    if not _BLOCK_ROWS:
        q = np.random.default_rng(0).integers(0, 16, size=(160, 96), dtype=np.uint8)
        theirs = _pack_int4_cpu_torch(q).numpy()
        _BLOCK_ROWS.append(next((b for b in (64, 32) if np.array_equal(pack_int4_cpu_numpy(q, b), theirs)), None))
    return _BLOCK_ROWS[0]


def _pack_int4_cpu(q: np.ndarray) -> torch.Tensor:
    """uint8 values [N, K] (0..15) -> the CPU kernel's packed [N, K / 2]."""
    block = int4_block_rows()
    if block is not None:
        return torch.from_numpy(pack_int4_cpu_numpy(q, block))
    return _pack_int4_cpu_torch(q)


def _pack_int4_cuda(q: np.ndarray, device: torch.device) -> tuple[torch.Tensor, int]:
    """uint8 values [N, K] -> tinygemm's CUDA layout (two values a byte, even index high), inner k tiles."""
    k = q.shape[1]
    inner = 8 if k % 128 == 0 else 4 if k % 64 == 0 else 2
    pairs = torch.from_numpy(np.ascontiguousarray((q[:, ::2] << 4) | q[:, 1::2])).to(device)
    return torch.ops.aten._convert_weight_to_int4pack(pairs, inner), inner


class Int4Linear:
    """int4 group-wise weights: q in 0..15 per value, bf16 (scale, zero) per 32 inputs and output.

    With `planes=2` it holds an 8-bit group-wise tensor exactly (Q8_0): w = 16 d hi + d lo as two int4 planes
    side by side along the input ([hi | lo], 2K wide), run as one kernel call on the input repeated twice
    ([x | x]). One int8 scale per output channel cannot keep Q8_0's 32-wide scales (docs/WEIGHTS.md)."""

    def __init__(self, packed: torch.Tensor, scale_zero: torch.Tensor, device: torch.device, planes: int = 1) -> None:
        """`packed` in the device kernel's layout, `scale_zero` bf16 [planes * K // 32, N, 2]."""
        self.packed, self.scale_zero, self.device = packed.to(device), scale_zero.to(device), device
        self.planes = planes
        self.out_features, self.in_features = scale_zero.shape[1], scale_zero.shape[0] * INT4_GROUP // planes
        self.kind = "int4" if planes == 1 else f"int4x{planes}"

    @classmethod
    def from_ints(cls, q: np.ndarray, scale: np.ndarray, zero: np.ndarray, device: torch.device,
                  planes: int = 1) -> Int4Linear:
        """q uint8 [N, K] (0..15), scale/zero fp32 [N, K // 32] with w = (q - 8) * scale + zero (K counts
        every plane)."""
        n, k = q.shape
        if n % 16 or k % INT4_GROUP:
            raise ValueError(f"int4 needs out % 16 == 0 and in % {INT4_GROUP} == 0, got [{n}, {k}]")
        q = np.ascontiguousarray(q, dtype=np.uint8)
        sz = torch.empty(k // INT4_GROUP, n, 2, dtype=torch.bfloat16)  # the kernel's [G, N, (scale, zero)]
        sz[..., 0], sz[..., 1] = torch.from_numpy(scale).t(), torch.from_numpy(zero).t()
        packed = _pack_int4_cuda(q, device)[0] if device.type == "cuda" else _pack_int4_cpu(q)
        return cls(packed, sz, device, planes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        if self.planes > 1:
            xb = xb.repeat(1, self.planes)
        if self.device.type == "cuda":
            y = torch.ops.aten._weight_int4pack_mm(xb, self.packed, INT4_GROUP, self.scale_zero)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, INT4_GROUP, self.scale_zero)
        return y.to(x.dtype)

    def dense(self) -> torch.Tensor:
        """The weights as the kernel sees them (fp32 [N, K]), read back through the kernel with an identity."""
        eye = torch.eye(self.in_features, device=self.device, dtype=torch.float32)
        return torch.cat([self(eye[a : a + 256]) for a in range(0, self.in_features, 256)]).t().contiguous().float()

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scale_zero.numel() * 2


def _int8_kernel_works(device: torch.device) -> bool:
    """Whether this torch build has `_weight_int8pack_mm` for the device (a 16x32 probe)."""
    try:
        torch.ops.aten._weight_int8pack_mm(
            torch.zeros(1, 32, dtype=torch.bfloat16, device=device),
            torch.zeros(16, 32, dtype=torch.int8, device=device),
            torch.ones(16, dtype=torch.bfloat16, device=device))
        return True
    except (RuntimeError, NotImplementedError):
        return False


_INT8_KERNEL: dict[str, bool] = {}


class Int8Linear:
    """int8 weights [N, K] with one bf16 scale per output channel."""

    kind = "int8"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, device: torch.device) -> None:
        self.out_features, self.in_features = q.shape
        self.q = q.to(device=device, dtype=torch.int8).contiguous()
        self.scale = scale.to(device=device, dtype=torch.bfloat16).contiguous()
        if device.type not in _INT8_KERNEL:
            _INT8_KERNEL[device.type] = _int8_kernel_works(device)
        self.fused = _INT8_KERNEL[device.type]

    @classmethod
    def quantize(cls, w: torch.Tensor, device: torch.device) -> Int8Linear:
        """Symmetric per-row int8 of an fp32 [N, K]: scale = max |w| / 127, q = round(w / scale)."""
        scale = w.abs().amax(dim=1).clamp_min(1e-30) / 127.0
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, scale, device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        if self.fused:
            y = torch.ops.aten._weight_int8pack_mm(xb, self.q, self.scale)
        else:  # a device without the fused kernel: the same values through a bf16 matmul
            y = F.linear(xb, self.q.to(torch.bfloat16)) * self.scale
        return y.to(x.dtype)

    def dense(self) -> torch.Tensor:
        return self.q.float() * self.scale.float()[:, None]

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 2


class ConcatLinear:
    """Several linears on the same input whose outputs are concatenated (fused q/k/v of mixed formats)."""

    def __init__(self, parts: list[Linear]) -> None:
        self.parts = parts
        self.kind = "+".join(sorted({p.kind for p in parts}))
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def dense(self) -> torch.Tensor:
        return torch.cat([p.dense() for p in self.parts])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


class RefinedHead:
    """A vocabulary head whose `top` largest logits per row are recomputed in fp32 from the exact weight rows.

    The packed kernels return bf16, whose spacing at a logit of 16..32 is 0.125: on the default model the
    greedy choice between two tokens 0.08 apart (fp32) then depends on the rounding. The exact rows come from
    the tied embedding (`rows`, the file's own values), so the top candidates are ranked as the exact model
    ranks them; every other logit keeps the kernel's value."""

    def __init__(self, base: Linear, rows: Rows, top: int = 16) -> None:
        self.base, self.rows, self.top = base, rows, top
        self.kind, self.out_features, self.in_features = base.kind, base.out_features, base.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x).float()
        ids = y.topk(min(self.top, y.shape[1]), dim=1).indices
        w = self.rows(ids.reshape(-1)).float().view(*ids.shape, self.in_features)
        exact = (w * x.float()[:, None, :]).sum(-1)
        return y.scatter_(1, ids, exact).to(x.dtype)

    def dense(self) -> torch.Tensor:
        return self.base.dense()

    @property
    def nbytes(self) -> int:
        return self.base.nbytes


class Rows(Protocol):
    """An embedding table: ids [T] -> [T, hidden] in the compute dtype."""

    kind: str

    def __call__(self, ids: torch.Tensor) -> torch.Tensor: ...

    def dense(self) -> torch.Tensor: ...

    @property
    def nbytes(self) -> int: ...


class DenseRows:
    """A plain [vocab, hidden] table."""

    def __init__(self, w: torch.Tensor, dtype: torch.dtype) -> None:
        self.w, self.dtype = w.contiguous(), dtype
        self.kind = DenseLinear(w).kind

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.w).to(self.dtype)

    def dense(self) -> torch.Tensor:
        return self.w.float()

    @property
    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size()


class GGUFRows:
    """The embedding kept as the file's own blocks (CPU): looked-up rows are unpacked on the fly, so the table
    costs exactly its bytes in the file and gives gguf's values."""

    def __init__(self, raw: np.ndarray, qtype: GGMLQuantizationType, k: int, dtype: torch.dtype) -> None:
        self.raw, self.qtype, self.k, self.dtype = raw, qtype, k, dtype
        self.kind = f"gguf-{qtype.name}"

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        rows = unpack_rows(self.raw[ids.cpu().numpy()], self.qtype, self.k).dequantize()
        return torch.from_numpy(rows).to(device=ids.device, dtype=self.dtype)

    def dense(self) -> torch.Tensor:
        ids = torch.arange(self.raw.shape[0])
        return torch.cat([self(ids[a : a + 4096]).float() for a in range(0, ids.numel(), 4096)])

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)


class GroupedRows:
    """int8 q [vocab, hidden] with fp32 scale/zero per `group` values: row = q * scale + zero (gguf's values)."""

    kind = "int8-rows"

    def __init__(self, q: np.ndarray, scale: np.ndarray, zero: np.ndarray, group: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.q = torch.from_numpy(np.ascontiguousarray(q).view(np.int8)).to(device)
        self.scale = torch.from_numpy(scale).to(device)
        self.zero = torch.from_numpy(zero).to(device)
        self.group, self.dtype = group, dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        t, k = ids.shape[0], self.q.shape[1]
        q = self.q[ids].float().view(t, -1, self.group)
        return (q * self.scale[ids][..., None] + self.zero[ids][..., None]).view(t, k).to(self.dtype)

    def dense(self) -> torch.Tensor:
        ids = torch.arange(self.q.shape[0], device=self.q.device)
        return torch.cat([self(ids[a : a + 4096]).float() for a in range(0, ids.numel(), 4096)])

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 8 * self.scale.numel()
