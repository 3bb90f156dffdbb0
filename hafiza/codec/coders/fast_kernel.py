"""The `fast` coder's decode kernel: symbols and packed mantissas back to bf16 bit patterns in one compiled
pass (numba), since a dozen numpy passes per chunk cost several times the Huffman decode itself. Imported on
first use (numba's import takes about a second); compiled once per installation and cached on disk."""

from __future__ import annotations

import numba
import numpy as np

from hafiza.codec.coders.fast import OFFSET, SIGN_CHANGE, SIGN_MAJORITY


@numba.njit(cache=True, nogil=True)
def join_bf16(symbols: np.ndarray, packed: np.ndarray, medians: np.ndarray, mode: int, majority: np.ndarray,
              out: np.ndarray) -> None:
    """out [tokens, channels] (uint16) from the symbol plane (uint8, tokens * channels), the packed mantissas
    (layout of `pack_mantissas`), the channels' median exponents (int16), the sign mode and, for
    SIGN_MAJORITY, each channel's majority sign (uint8)."""
    tokens, channels = out.shape
    n = tokens * channels
    q = n // 8
    mant = np.empty(n, np.uint8)
    for i in range(7 * q):
        mant[i] = packed[i] & 0x7F
    for r in range(q):
        m = 0
        for j in range(7):
            m |= (packed[j * q + r] >> 7) << j
        mant[7 * q + r] = m
    for i in range(8 * q, n):
        mant[i] = packed[i - q]
    state = np.zeros(channels, np.uint16)
    base = np.empty(channels, np.uint16)
    for c in range(channels):
        base[c] = np.uint16((medians[c] - OFFSET) & 0xFF)
    for t in range(tokens):
        row = t * channels
        for c in range(channels):
            a = np.uint16(symbols[row + c])
            s = a >> 7
            if mode == SIGN_CHANGE:
                s ^= state[c]
                state[c] = s
            elif mode == SIGN_MAJORITY:
                s ^= majority[c]
            e = ((a & 0x7F) + base[c]) & 0xFF
            out[t, c] = (s << 15) | (e << 7) | mant[row + c]
