"""The integrity frame the store adds around every value it writes to disk or Redis.

Layout (little-endian): magic b"HZKV" | version u8 | flags u8 (0) | key length u16 | payload length u64 |
CRC-32 u32 | key (UTF-8) | payload. The CRC covers the key and the payload; the key inside the frame
guards against a value found under the wrong key (file-name hash collision, a mis-written Redis key).
"""

from __future__ import annotations

import struct
import zlib

MAGIC = b"HZKV"
VERSION = 1
HEADER = struct.Struct("<4sBBHQI")


class FrameError(ValueError):
    """Stored bytes that are not an intact frame for the requested key (flipped, truncated, foreign)."""


def frame_header(key: str, payload: bytes | memoryview) -> bytes:
    """The header and key to write before `payload` (kept apart so large payloads are not copied)."""
    kb = key.encode()
    if len(kb) > 0xFFFF:
        raise ValueError(f"key of {len(kb)} bytes is longer than a frame allows (65535)")
    crc = zlib.crc32(payload, zlib.crc32(kb))
    return HEADER.pack(MAGIC, VERSION, 0, len(kb), len(payload), crc) + kb


def pack(key: str, payload: bytes | memoryview) -> bytes:
    """The whole frame as one bytes object."""
    return frame_header(key, payload) + bytes(payload)


def unpack(key: str, data: bytes | memoryview) -> bytes:
    """The payload of an intact frame stored under `key`; raises FrameError on any mismatch."""
    view = memoryview(data)
    if len(view) < HEADER.size:
        raise FrameError(f"frame of {len(view)} bytes is shorter than its header ({HEADER.size})")
    magic, version, flags, key_len, payload_len, crc = HEADER.unpack_from(view)
    if magic != MAGIC or version != VERSION or flags != 0:
        raise FrameError(f"bad frame header (magic={bytes(magic)!r}, version={version}, flags={flags})")
    if len(view) != HEADER.size + key_len + payload_len:
        raise FrameError(f"frame length {len(view)} != {HEADER.size} + {key_len} + {payload_len}")
    kb = view[HEADER.size : HEADER.size + key_len]
    payload = view[HEADER.size + key_len :]
    if zlib.crc32(payload, zlib.crc32(kb)) != crc:
        raise FrameError("frame checksum mismatch")
    if kb != key.encode():
        raise FrameError(f"frame holds key {bytes(kb)!r}, not {key!r}")
    return payload.tobytes()
