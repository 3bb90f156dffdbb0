"""Peers measured in the same run: zstd on raw bytes, byte-shuffle + zstd, and ZipNN (given a copy: its
compress() rewrites its input buffer in place)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import zstandard

Codec = tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]


def zstd_raw(level: int) -> Codec:
    c, d = zstandard.ZstdCompressor(level=level, threads=0), zstandard.ZstdDecompressor()
    return c.compress, d.decompress


def zstd_shuffled(level: int, nbytes: int) -> Codec:
    """Byte planes of the whole tensor, then zstd."""
    c, d = zstandard.ZstdCompressor(level=level, threads=0), zstandard.ZstdDecompressor()

    def compress(raw: bytes) -> bytes:
        return c.compress(np.frombuffer(raw, np.uint8).reshape(-1, nbytes).T.tobytes())

    def decompress(data: bytes) -> bytes:
        return np.ascontiguousarray(np.frombuffer(d.decompress(data), np.uint8).reshape(nbytes, -1).T).tobytes()

    return compress, decompress


def zipnn(dtype: str) -> Codec | None:
    """ZipNN with one thread, or None when it is not installed (it is a dev dependency)."""
    try:
        from zipnn import ZipNN
    except ImportError:
        return None
    z = ZipNN(input_format="byte", bytearray_dtype=dtype, threads=1)
    return (lambda raw: bytes(z.compress(bytearray(raw)))), (lambda data: bytes(z.decompress(data)))
