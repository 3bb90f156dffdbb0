"""The `fast` coder's decode kernel: a chunk's payload (after its Huffman frame is decompressed) back to bf16
bit patterns in one compiled call (numba): mantissas, signs, exponents, the majority row and the escapes.
Per-chunk Python work and numpy passes cost as much as the Huffman decode itself, so all of it is here.
Arrays are only ever indexed through slices and range() indices: numba checks an `a[x + k]` index for
wrap-around, which stops LLVM from vectorising the loop.
Imported on first use (numba's import takes about a second); compiled once per installation, cached on disk."""

from __future__ import annotations

import numba
import numpy as np

from hafiza.codec.coders.fast_modes import SIGN_CHANGE, SIGN_MAJORITY

_U16 = np.uint16


@numba.njit(cache=True, nogil=True)
def decode_chunk(symbols: np.ndarray, payload: np.ndarray, frame_end: int, mant_end: int, row_end: int,
                 escapes: int, base: np.ndarray, mode: int, out: np.ndarray) -> int:
    """out [tokens, channels] (uint16) from the decompressed symbol plane (uint8, tokens * channels) and the
    payload's bytes: packed mantissas in [frame_end, mant_end) (layout of `pack_mantissas`), the majority
    row in [mant_end, row_end) for SIGN_MAJORITY, then `escapes` positions (<u4) and patterns (<u2).
    `base` is each channel's median exponent minus the symbol offset, mod 256 (uint16). Returns -1, or the
    position an escape points at when that is past the chunk's values (the payload is damaged)."""
    tokens, channels = out.shape
    n = tokens * channels
    q = n // 8
    packed = payload[frame_end:mant_end]
    mant = np.empty(n, np.uint8)
    for i in range(7 * q):
        mant[i] = packed[i] & 0x7F
    tail = mant[7 * q :]
    for r in range(q):
        tail[r] = 0
    for j in range(7):
        carriers = packed[j * q : (j + 1) * q]
        for r in range(q):
            tail[r] |= (carriers[r] >> 7) << j
    rest = packed[7 * q :]
    for i in range(n - 8 * q):
        tail[q + i] = rest[i]
    flip = np.zeros(channels, np.uint16)
    if mode == SIGN_MAJORITY:
        row = payload[mant_end:row_end]
        for c in range(channels):
            flip[c] = ((row[c // 8] >> (c % 8)) & 1) << 15
    state = np.zeros(channels, np.uint16)
    for t in range(tokens):
        sym = symbols[t * channels : (t + 1) * channels]
        mt = mant[t * channels : (t + 1) * channels]
        o = out[t]
        if mode == SIGN_CHANGE:
            for c in range(channels):
                a = np.uint16(sym[c])
                s = (a >> 7) ^ state[c]
                state[c] = s
                o[c] = (s << 15) | ((((a & 0x7F) + base[c]) & 0xFF) << 7) | mt[c]
        else:  # kept in uint16 arithmetic (flip holds the sign at bit 15), which LLVM vectorises better
            for c in range(channels):
                a = _U16(sym[c])
                o[c] = (((a & _U16(0x80)) << _U16(8)) ^ flip[c]) | ((((a & _U16(0x7F)) + base[c]) << _U16(7))
                                                                     & _U16(0x7F80)) | _U16(mt[c])
    esc = payload[row_end : row_end + 6 * escapes]
    flat = out.reshape(-1)
    for k in range(escapes):
        where = (np.int64(esc[4 * k]) | (np.int64(esc[4 * k + 1]) << 8) | (np.int64(esc[4 * k + 2]) << 16)
                 | (np.int64(esc[4 * k + 3]) << 24))
        if where >= n:
            return where
        flat[where] = np.uint16(esc[4 * escapes + 2 * k]) | (np.uint16(esc[4 * escapes + 2 * k + 1]) << 8)
    return -1
