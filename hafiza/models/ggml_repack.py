"""GGUF blocks straight into the run-time formats in one compiled pass per row range (numba, GIL released).

The same integers and the same fp32 arithmetic as `ggml_blocks.unpack_rows` followed by the numpy/torch repacking
in `weights.py` (which stays the reference: tests/models/test_ggml_repack.py compares both bit for bit), without
the dozen whole-chunk numpy temporaries per tensor that made a 1.5B model take ~40 s to load:

- `int4_rows`: 4-bit blocks (Q4_0, Q4_1, Q4_K) -> the CPU int4 kernel's packed layout (32- or 64-row blocks,
  as the running ISA's kernel reads them) + fp32 scale / zero.
- `int4x2_rows`: Q8_0 -> two int4 planes [hi | lo] in that layout + fp32 scale / zero.
- `int8_rows`: any supported type -> int8 per output row (dequantized, then q = round(w / (max|w| / 127))).
- `dequant_rows`: any supported type -> fp32 (gguf's values).

Values move 8 at a time as uint64 words (nibbles split with masks, 8x8 byte blocks transposed in registers) and
indices are unsigned (numba then drops its negative-index check, which kept LLVM from vectorizing the float loops).
Compiled once per installation and cached on disk (numba's `cache=True`).
"""

from __future__ import annotations

import numba
import numpy as np
from gguf import GGMLQuantizationType as T

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = int(T.Q4_0), int(T.Q4_1), int(T.Q5_0), int(T.Q5_1), int(T.Q8_0)
Q4_K, Q5_K, Q6_K = int(T.Q4_K), int(T.Q5_K), int(T.Q6_K)
KERNEL_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K})
INT4_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q4_K})
ROUND = np.float32(3 << 22)  # x + ROUND - ROUND rounds an fp32 |x| < 2**22 to the nearest integer, ties to even
U = np.uint64
LOW4, LOW2, ONES, SIGNS = U(0x0F0F0F0F0F0F0F0F), U(0x0303030303030303), U(0x0101010101010101), U(0x8080808080808080)
SPREAD = np.array([sum(((i >> b) & 1) << (8 * b) for b in range(8)) for i in range(256)], dtype=np.uint64)  # bit->byte
F16_TABLE = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)  # exact: every f16 is an f32


def group_of(qtype: T) -> int:
    """Values per scale / zero of a type (Q6_K: 16, the others: 32)."""
    return 16 if qtype == T.Q6_K else 32


@numba.njit(cache=True, nogil=True, inline="always")
def _half(row: np.ndarray, o: int, f16: np.ndarray) -> np.float32:
    return f16[U(row[U(o)]) | (U(row[U(o + 1)]) << U(8))]


@numba.njit(cache=True, nogil=True, inline="always")
def _word(row: np.ndarray, o: int) -> np.uint64:
    """The 8 bytes at row[o:] as a little-endian uint64, any alignment (LLVM merges the byte loads)."""
    i = U(o)
    return (U(row[i]) | (U(row[i + U(1)]) << U(8)) | (U(row[i + U(2)]) << U(16)) | (U(row[i + U(3)]) << U(24))
            | (U(row[i + U(4)]) << U(32)) | (U(row[i + U(5)]) << U(40)) | (U(row[i + U(6)]) << U(48))
            | (U(row[i + U(7)]) << U(56)))


@numba.njit(cache=True, nogil=True, inline="always")
def _block_values(qt: int) -> int:
    return 256 if qt in (Q4_K, Q5_K, Q6_K) else 32


@numba.njit(cache=True, nogil=True)
def _decode_block(row: np.ndarray, qt: int, f16: np.ndarray, b: int, q: np.ndarray, wo: int, scale: np.ndarray,
                  zero: np.ndarray, so: int) -> None:
    """Block b of a row -> its 32 (256 for K-quants) values as words q[wo:] (one uint8 value a byte; Q8_0's int8
    as its bits) and its groups' scale / zero at scale[so:], zero[so:], with w = q * scale + zero."""
    if qt in (Q4_0, Q4_1, Q5_0, Q5_1):
        o = b * (18 if qt == Q4_0 else 20 if qt == Q4_1 else 22 if qt == Q5_0 else 24)
        d = _half(row, o, f16)
        scale[U(so)] = d
        if qt in (Q4_1, Q5_1):
            zero[U(so)] = _half(row, o + 2, f16)
            o += 4
        else:
            zero[U(so)] = -d * np.float32(8.0 if qt == Q4_0 else 16.0)
            o += 2
        qh = o
        if qt in (Q5_0, Q5_1):
            o += 4
        a, c = _word(row, o), _word(row, o + 8)
        w = (a & LOW4, c & LOW4, (a >> U(4)) & LOW4, (c >> U(4)) & LOW4)  # values 0-7, 8-15, 16-23, 24-31
        for i in range(4):
            v = w[i]
            if qt in (Q5_0, Q5_1):  # bit j of qh is bit 4 of value j
                v |= SPREAD[row[U(qh + i)]] << U(4)
            q[U(wo + i)] = v
    elif qt == Q8_0:
        o = b * 34
        scale[U(so)] = _half(row, o, f16)
        zero[U(so)] = np.float32(0.0)
        for i in range(4):
            q[U(wo + i)] = _word(row, o + 2 + 8 * i)
    elif qt in (Q4_K, Q5_K):
        o = b * (144 if qt == Q4_K else 176)
        qs = o + (16 if qt == Q4_K else 48)
        d, dmin = _half(row, o, f16), _half(row, o + 2, f16)
        for j in range(8):
            if j < 4:
                sc = row[U(o + 4 + j)] & 63
                mn = row[U(o + 8 + j)] & 63
            else:
                sc = (row[U(o + 8 + j)] & 15) | ((row[U(o + j)] >> 2) & 0x30)
                mn = (row[U(o + 8 + j)] >> 4) | ((row[U(o + 4 + j)] >> 2) & 0x30)
            scale[U(so + j)] = d * np.float32(sc)
            zero[U(so + j)] = -(dmin * np.float32(mn))
        for g in range(8):  # group g: bytes (g // 2) * 32.. of qs, low nibbles for even g, high for odd
            base, shift = qs + (g >> 1) * 32, U(4 * (g & 1))
            for i in range(4):
                v = (_word(row, base + 8 * i) >> shift) & LOW4
                if qt == Q5_K:  # bit g of qh[i] is bit 4 of value i of group g
                    v |= ((_word(row, o + 16 + 8 * i) >> U(g)) & ONES) << U(4)
                q[U(wo + 4 * g + i)] = v
    elif qt == Q6_K:
        o = b * 210
        d = _half(row, o + 208, f16)
        for j in range(16):
            s = d * np.float32(np.int8(row[U(o + 192 + j)]))
            scale[U(so + j)] = s
            zero[U(so + j)] = -np.float32(32.0) * s
        for half in range(2):  # value p of a half: low 4 bits from ql, high 2 from qh
            for i in range(16):
                p = 8 * i
                lo = (_word(row, o + half * 64 + (p & 63)) >> U(4 * (p >> 6))) & LOW4
                hi = (_word(row, o + 128 + half * 32 + (p & 31)) >> U(2 * (p >> 5))) & LOW2
                q[U(wo + half * 16 + i)] = lo | (hi << U(4))
    else:
        raise ValueError("GGUF tensor type without a compiled unpacker")


@numba.njit(cache=True, nogil=True)
def _decode_row(row: np.ndarray, qt: int, f16: np.ndarray, q: np.ndarray, scale: np.ndarray,
                zero: np.ndarray) -> None:
    """One row of blocks -> q words [K / 8] and scale / zero per group."""
    bv = _block_values(qt)
    gpb = bv // (q.shape[0] * 8 // scale.shape[0])
    for b in range(q.shape[0] * 8 // bv):
        _decode_block(row, qt, f16, b, q, b * bv // 8, scale, zero, b * gpb)


@numba.njit(cache=True, nogil=True, inline="always")
def _value(qb: np.ndarray, i: int, signed: bool) -> np.int32:
    v = np.int32(qb[U(i)])
    if signed:
        v = v - ((v >> 7) << 8)  # the int8 the bits stand for
    return v


@numba.njit(cache=True, nogil=True, inline="always")
def _bf16(x: np.float32, box: np.ndarray, bits: np.ndarray) -> np.uint16:
    """torch's fp32 -> bf16 rounding (to nearest, ties to even; NaN -> 0x7FC0); box / bits: one float32 and its
    uint32 view."""
    if x != x:
        return np.uint16(0x7FC0)
    box[0] = x
    b = bits[0]
    return np.uint16((b + ((b >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)) >> np.uint32(16))


@numba.njit(cache=True, nogil=True, inline="always")
def _transpose8(x: np.ndarray) -> None:
    """x [8] uint64 as an 8x8 byte matrix (byte c of x[r] is element (r, c)) transposed in place."""
    for r in range(4):
        t = ((x[r] >> U(32)) ^ x[r + 4]) & U(0x00000000FFFFFFFF)
        x[r] ^= t << U(32)
        x[r + 4] ^= t
    for r in (0, 1, 4, 5):
        t = ((x[r] >> U(16)) ^ x[r + 2]) & U(0x0000FFFF0000FFFF)
        x[r] ^= t << U(16)
        x[r + 2] ^= t
    for r in (0, 2, 4, 6):
        t = ((x[r] >> U(8)) ^ x[r + 1]) & U(0x00FF00FF00FF00FF)
        x[r] ^= t << U(8)
        x[r + 1] ^= t


@numba.njit(cache=True, nogil=True)
def _emit_group(tile: np.ndarray, c0: int, out: np.ndarray, kk0: int, x: np.ndarray) -> None:
    """32 values (words c0..c0+3) of the B rows of tile [B, words] -> out [K, B / 16] (one B-row block of the
    packed layout as words) at inputs kk0..kk0+31: byte j of input kk is row j's value | row j + B / 2's << 4."""
    half = tile.shape[0] // 2
    for rb in range(half // 8):
        for c in range(4):
            for r in range(8):
                j = rb * 8 + r
                x[r] = tile[j, c0 + c] | (tile[j + half, c0 + c] << U(4))
            _transpose8(x)
            for b in range(8):
                out[U(kk0 + c * 8 + b), U(rb)] = x[b]


@numba.njit(cache=True, nogil=True)
def int4_rows(raw: np.ndarray, qt: int, f16: np.ndarray, row0: int, packed: np.ndarray, sz: np.ndarray) -> None:
    """raw [r, bytes] (r a multiple of the block B) of a 4-bit 32-wide type -> rows row0..row0 + r of packed
    [N // B, K, B / 16] uint64 (the kernel's [N // B, K, B / 2] bytes: row j of a B-row block in the low nibble,
    j + B / 2 in the high one; B = 64 under AVX-512, 32 under AVX2) and of sz [K // 32, N, 2], the bf16 bits of
    (scale, zero + 8 * scale): the kernel computes (q - 8) * scale + zero. One block of B rows at a time, so the
    tile stays in the L1 cache."""
    k = packed.shape[1]
    rows = packed.shape[2] * 16
    bv = _block_values(qt)
    gpb = bv // 32
    tile = np.empty((rows, bv // 8), np.uint64)
    s_blk = np.empty(gpb, np.float32)
    z_blk = np.empty(gpb, np.float32)
    x = np.empty(8, np.uint64)
    box = np.empty(1, np.float32)
    bits = box.view(np.uint32)
    for blk in range(raw.shape[0] // rows):
        n = row0 + blk * rows
        out = packed[row0 // rows + blk]
        for b in range(k // bv):
            for j in range(rows):
                _decode_block(raw[blk * rows + j], qt, f16, b, tile[j], 0, s_blk, z_blk, 0)
                for g in range(gpb):
                    sz[U(b * gpb + g), U(n + j), 0] = _bf16(s_blk[g], box, bits)
                    sz[U(b * gpb + g), U(n + j), 1] = _bf16(z_blk[g] + np.float32(8.0) * s_blk[g], box, bits)
            for g in range(gpb):
                _emit_group(tile, 4 * g, out, b * bv + 32 * g, x)


@numba.njit(cache=True, nogil=True)
def int4x2_rows(raw: np.ndarray, f16: np.ndarray, row0: int, packed: np.ndarray, sz: np.ndarray) -> None:
    """Q8_0 raw [r, bytes] -> two int4 planes, u = q + 128, hi = u >> 4 at inputs 0..K-1 and lo = u & 15 at
    K..2K-1 of packed [N // B, 2K, B / 16] uint64 (layout of int4_rows); sz [2K // 32, N, 2] holds the bf16 bits
    of (16 s, 0) for hi and (s, 8 s) for lo (weights.two_plane_parts' values)."""
    k = packed.shape[1] // 2
    rows = packed.shape[2] * 16
    groups = k // 32
    q = np.empty((rows, 4), np.uint64)
    hi = np.empty((rows, 4), np.uint64)
    lo = np.empty((rows, 4), np.uint64)
    s_blk = np.empty(1, np.float32)
    z_blk = np.empty(1, np.float32)
    x = np.empty(8, np.uint64)
    box = np.empty(1, np.float32)
    bits = box.view(np.uint32)
    for blk in range(raw.shape[0] // rows):
        n = row0 + blk * rows
        out = packed[row0 // rows + blk]
        for b in range(groups):
            for j in range(rows):
                _decode_block(raw[blk * rows + j], Q8_0, f16, b, q[j], 0, s_blk, z_blk, 0)
                for i in range(4):
                    u = q[j, i] ^ SIGNS
                    hi[j, i] = (u >> U(4)) & LOW4
                    lo[j, i] = u & LOW4
                s = s_blk[0]
                sz[U(b), U(n + j), 0] = _bf16(np.float32(16.0) * s, box, bits)
                sz[U(b), U(n + j), 1] = 0
                sz[U(groups + b), U(n + j), 0] = _bf16(s, box, bits)
                sz[U(groups + b), U(n + j), 1] = _bf16(z_blk[0] + s * np.float32(8.0), box, bits)
            _emit_group(hi, 0, out, 32 * b, x)
            _emit_group(lo, 0, out, k + 32 * b, x)


@numba.njit(cache=True, nogil=True)
def int8_rows(raw: np.ndarray, qt: int, f16: np.ndarray, group: int, q_out: np.ndarray,
              scale_out: np.ndarray) -> None:
    """raw [r, bytes] -> q_out [r, K] int8 and scale_out [r] fp32: the row dequantized exactly, then
    s = max(max |w|, 1e-30) / 127 and q = round-half-even(w / s) clamped to +-127 (weights._int8's values)."""
    k = q_out.shape[1]
    groups = k // group
    q = np.empty(k // 8, np.uint64)
    qb = q.view(np.uint8)
    s = np.empty(groups, np.float32)
    z = np.empty(groups, np.float32)
    signed = qt == Q8_0
    for r in range(raw.shape[0]):
        _decode_row(raw[r], qt, f16, q, s, z)
        top = np.float32(0.0)
        for g in range(groups):  # |q * s + z| is largest at the group's smallest or largest q (monotone in q)
            lo, hi = np.int32(1 << 30), np.int32(-(1 << 30))
            for i in range(group):
                v = _value(qb, g * group + i, signed)
                lo, hi = min(lo, v), max(hi, v)
            top = max(top, abs(np.float32(lo) * s[g] + z[g]), abs(np.float32(hi) * s[g] + z[g]))
        sc = max(top, np.float32(1e-30)) / np.float32(127.0)
        scale_out[r] = sc
        row = q_out[r]
        for g in range(groups):
            sg, zg, o = s[g], z[g], U(g * group)
            for i in range(U(group)):
                x = (np.float32(_value(qb, o + i, signed)) * sg + zg) / sc
                x = (x + ROUND) - ROUND  # round half to even, as torch.round, for |x| < 2**22
                row[o + i] = np.int8(min(max(x, np.float32(-127.0)), np.float32(127.0)))


@numba.njit(cache=True, nogil=True)
def dequant_rows(raw: np.ndarray, qt: int, f16: np.ndarray, group: int, out: np.ndarray) -> None:
    """raw [r, bytes] -> out [r, K] fp32, gguf's own values: q * scale + zero, two fp32 roundings as numpy does
    them (no fused multiply-add)."""
    k = out.shape[1]
    groups = k // group
    q = np.empty(k // 8, np.uint64)
    qb = q.view(np.uint8)
    s = np.empty(groups, np.float32)
    z = np.empty(groups, np.float32)
    signed = qt == Q8_0
    for r in range(raw.shape[0]):
        _decode_row(raw[r], qt, f16, q, s, z)
        row = out[r]
        for g in range(groups):
            sg, zg, o = s[g], z[g], U(g * group)
            for i in range(U(group)):
                row[o + i] = np.float32(_value(qb, o + i, signed)) * sg + zg
