"""A model block's arrays serialised as one zstd-compressed blob (integer arrays only)."""

from __future__ import annotations

import struct

import numpy as np
import zstandard

from hafiza.codec.errors import FormatError

_DTYPES = [np.dtype(t) for t in ("<i8", "<i4", "<i2", "<u1", "<u2", "<u4", "<i1")]


def pack_arrays(arrays: list[np.ndarray]) -> bytes:
    """Concatenate (dtype code, length, bytes) records and compress them."""
    parts = [struct.pack("<I", len(arrays))]
    for a in arrays:
        dt = a.dtype.newbyteorder("<")
        parts.append(struct.pack("<BQ", _DTYPES.index(dt), a.size))
        parts.append(np.ascontiguousarray(a, dt).tobytes())
    return zstandard.ZstdCompressor(level=19).compress(b"".join(parts))


def unpack_arrays(data: bytes | memoryview) -> list[np.ndarray]:
    """Inverse of pack_arrays; FormatError on anything malformed."""
    try:
        raw = zstandard.ZstdDecompressor().decompress(bytes(data), max_output_size=1 << 31)
        (n,) = struct.unpack_from("<I", raw, 0)
        pos, out = 4, []
        for _ in range(n):
            code, size = struct.unpack_from("<BQ", raw, pos)
            pos += 9
            dt = _DTYPES[code]
            end = pos + size * dt.itemsize
            if end > len(raw):
                raise FormatError("model block array runs past its end")
            out.append(np.frombuffer(raw, dt, size, pos).copy())
            pos = end
    except (zstandard.ZstdError, struct.error, IndexError) as exc:
        raise FormatError(f"hafiza KV container model block is malformed ({exc})") from exc
    return out
