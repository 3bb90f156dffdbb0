"""Fixed-width bit fields packed densely and vectorised: whole byte planes, then 8-value groups."""

from __future__ import annotations

import numpy as np

_SHIFTS = np.arange(8, dtype=np.uint64)


def packed_size(count: int, width: int) -> int:
    """Bytes that pack(values of `count`, width) produces."""
    planes, rest = divmod(width, 8)
    groups = -(-count // 8)
    return count * planes + groups * rest


def pack(values: np.ndarray, width: int) -> bytes:
    """The low `width` bits (0..32) of each value, densely packed; values must already fit in `width` bits."""
    v = np.ascontiguousarray(values).reshape(-1).astype(np.uint32, copy=False)
    planes, rest = divmod(width, 8)
    parts = [((v >> np.uint32(rest + 8 * p)) & np.uint32(0xFF)).astype(np.uint8).tobytes()
             for p in range(planes)]
    if rest:
        low = (v & np.uint32((1 << rest) - 1)).astype(np.uint64)
        pad = (-low.size) % 8
        if pad:
            low = np.concatenate([low, np.zeros(pad, np.uint64)])
        words = (low.reshape(-1, 8) << (_SHIFTS * np.uint64(rest))).sum(axis=1, dtype=np.uint64)
        parts.append(words.view(np.uint8).reshape(-1, 8)[:, :rest].tobytes())
    return b"".join(parts)


def unpack(data: bytes | memoryview, count: int, width: int) -> np.ndarray:
    """Inverse of pack: `count` uint32 values of `width` bits from exactly packed_size(count, width) bytes."""
    buf = np.frombuffer(data, np.uint8)
    planes, rest = divmod(width, 8)
    out = np.zeros(count, np.uint32)
    for p in range(planes):
        out |= buf[p * count : (p + 1) * count].astype(np.uint32) << np.uint32(rest + 8 * p)
    if rest:
        groups = -(-count // 8)
        tail = buf[planes * count : planes * count + groups * rest].reshape(groups, rest)
        wide = np.zeros((groups, 8), np.uint8)
        wide[:, :rest] = tail
        words = wide.view(np.uint64).reshape(groups, 1)
        low = ((words >> (_SHIFTS * np.uint64(rest))) & np.uint64((1 << rest) - 1)).reshape(-1)[:count]
        out |= low.astype(np.uint32)
    return out
