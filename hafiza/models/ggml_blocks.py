"""GGUF quantized blocks as integers with per-group scale and offset: w = q * scale + zero, exactly as gguf computes.

One row range of one tensor at a time (no whole-model fp32 copy). Each format keeps its own integers: 4-bit formats
give q in 0..15 with 32-wide groups (ready for int4 group-wise kernels), 5/6/8-bit formats give their wider
integers. `tests/models/test_ggml_blocks.py` checks every format bit-exactly against `gguf.quants.dequantize`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T

QK_K = 256


@dataclass
class GroupedInts:
    """Integers q [rows, K] (uint8, or int8 for Q8_0) with fp32 scale/zero [rows, K // group]."""

    q: np.ndarray
    scale: np.ndarray
    zero: np.ndarray
    group: int
    bits: int

    def dequantize(self) -> np.ndarray:
        """fp32 [rows, K] with gguf's own arithmetic (q * scale + zero in fp32)."""
        rows, k = self.q.shape
        g = self.q.reshape(rows, -1, self.group).astype(np.float32)
        return (g * self.scale[..., None] + self.zero[..., None]).reshape(rows, k)


# (block bytes, values per block, bits of q, group width) for the formats unpacked here
BLOCK = {
    T.Q4_0: (18, 32, 4, 32), T.Q4_1: (20, 32, 4, 32), T.Q5_0: (22, 32, 5, 32), T.Q5_1: (24, 32, 5, 32),
    T.Q8_0: (34, 32, 8, 32), T.Q4_K: (144, QK_K, 4, 32), T.Q5_K: (176, QK_K, 5, 32), T.Q6_K: (210, QK_K, 6, 16),
}
SUPPORTED = frozenset(BLOCK)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: low nibbles are values 0..15, high nibbles 16..31 (ggml's Q4_0/Q4_1/Q5 order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """4 bytes little-endian -> bit j of value j (Q5_0 / Q5_1)."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes of 6-bit scales and mins for the 8 sub-blocks of Q4_K / Q5_K."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def unpack_rows(raw: np.ndarray, qtype: T, k: int) -> GroupedInts:
    """raw [rows, bytes per row] of one GGUF tensor -> GroupedInts for those rows."""
    size, _, bits, group = BLOCK[qtype]
    rows = raw.shape[0]
    b = np.ascontiguousarray(raw).reshape(-1, size)
    n = b.shape[0]
    if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        d = _f16(b[:, 0:2])[:, 0]
        if qtype == T.Q8_0:
            q = b[:, 2:].view(np.int8)
            zero = np.zeros_like(d)
        else:
            off = 4 if qtype in (T.Q4_1, T.Q5_1) else 2
            qh = b[:, off : off + 4] if qtype in (T.Q5_0, T.Q5_1) else None
            q = _nibbles32(b[:, off + (4 if qh is not None else 0) :])
            if qh is not None:
                q = q | (_high_bits32(qh) << 4)
            offset = _f16(b[:, 2:4])[:, 0] if qtype in (T.Q4_1, T.Q5_1) else None
            zero = offset if offset is not None else -d * np.float32(8 if qtype == T.Q4_0 else 16)
        scale = d
    elif qtype in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mn = _k_scale_min(b[:, 4:16])
        scale, zero = d * sc, -(dmin * mn)
        if qtype == T.Q4_K:
            qs = b[:, 16:144].reshape(n, 4, 1, 32)
            q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, QK_K)
        else:
            qh = b[:, 16:48].reshape(n, 1, 32)
            qs = b[:, 48:176].reshape(n, 4, 1, 32)
            lo = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32)
            hi = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
            q = (lo | (hi << 4)).reshape(n, QK_K)
    elif qtype == T.Q6_K:
        ql = b[:, 0:128].reshape(n, 2, 1, 64)
        qh = b[:, 128:192].reshape(n, 2, 1, 32)
        sc = b[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(b[:, 208:210])
        lo = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(n, 2, 4, 32)
        hi = ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3).reshape(n, 2, 4, 32)
        q = (lo | (hi << 4)).reshape(n, QK_K)
        scale = d * sc
        zero = -np.float32(32) * scale
    else:
        raise ValueError(f"GGUF tensor type {qtype.name} is not unpacked here")
    groups = k // group
    return GroupedInts(
        q=np.ascontiguousarray(q).reshape(rows, k),
        scale=np.ascontiguousarray(scale, dtype=np.float32).reshape(rows, groups),
        zero=np.ascontiguousarray(zero, dtype=np.float32).reshape(rows, groups),
        group=group,
        bits=bits,
    )
