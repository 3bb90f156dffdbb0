"""The framed container: magic, version, header (dtype, shape, coder, predictor, chunk table) with its own
checksum, a coder model block, then the chunk payloads. Reading verifies framing and raises, never guesses."""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field

from hafiza.codec.errors import FormatError, VersionError
from hafiza.codec.formats import BY_CODE, BitFormat

MAGIC = b"HKVC"
VERSION = 1
DIGEST_BYTES = 16
MAX_NDIM = 16
_PRELUDE = struct.Struct("<4sHI")
_FIXED = struct.Struct("<BBBB")
_TAIL = struct.Struct(f"<I{DIGEST_BYTES}s{DIGEST_BYTES}sIII")
_CHUNK = struct.Struct("<III")
_CRC = struct.Struct("<I")


@dataclass
class ChunkRecord:
    """One chunk's payload length, CRC-32 of its raw bit patterns, CRC-32 of its prediction (0 if none)."""

    length: int
    raw_crc: int
    prediction_crc: int = 0


@dataclass
class Header:
    """Everything a decoder must know before touching payloads."""

    fmt: BitFormat
    shape: tuple[int, ...]
    coder_id: int
    predictor_id: int
    chunk_tokens: int
    predictor_fingerprint: bytes = bytes(DIGEST_BYTES)
    input_digest: bytes = bytes(DIGEST_BYTES)
    model_crc: int = 0
    model_len: int = 0
    chunks: list[ChunkRecord] = field(default_factory=list)


def write(header: Header, model: bytes, payloads: list[bytes]) -> bytes:
    """Serialise a container; header.chunks must already hold each payload's checksums."""
    header.model_len, header.model_crc = len(model), zlib.crc32(model)
    for rec, p in zip(header.chunks, payloads, strict=True):
        rec.length = len(p)
    body = [_FIXED.pack(header.fmt.code, header.coder_id, header.predictor_id, len(header.shape))]
    body.append(struct.pack(f"<{len(header.shape)}Q", *header.shape))
    body.append(_TAIL.pack(header.chunk_tokens, header.predictor_fingerprint, header.input_digest,
                           header.model_len, header.model_crc, len(header.chunks)))
    body.extend(_CHUNK.pack(c.length, c.raw_crc, c.prediction_crc) for c in header.chunks)
    body_bytes = b"".join(body)
    head = _PRELUDE.pack(MAGIC, VERSION, len(body_bytes)) + body_bytes
    return b"".join([head, _CRC.pack(zlib.crc32(head)), model, *payloads])


def read(data: bytes | bytearray | memoryview) -> tuple[Header, memoryview, list[memoryview]]:
    """Parse and verify framing; returns the header, the model block and one view per chunk payload."""
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    if len(view) < _PRELUDE.size:
        raise FormatError("not a hafiza KV container: too short to hold a header")
    magic, version, body_len = _PRELUDE.unpack_from(view, 0)
    if magic != MAGIC:
        raise FormatError("not a hafiza KV container: bad magic bytes")
    if version != VERSION:
        raise VersionError(f"hafiza KV container format version {version}; this build reads {VERSION}")
    head_end = _PRELUDE.size + body_len
    if len(view) < head_end + _CRC.size:
        raise FormatError("hafiza KV container truncated inside its header")
    (head_crc,) = _CRC.unpack_from(view, head_end)
    if zlib.crc32(view[:head_end]) != head_crc:
        raise FormatError("hafiza KV container header is corrupt (header checksum mismatch)")
    header = _parse_body(view[_PRELUDE.size : head_end])
    pos = head_end + _CRC.size
    model = view[pos : pos + header.model_len]
    pos += header.model_len
    payloads = []
    for rec in header.chunks:
        payloads.append(view[pos : pos + rec.length])
        pos += rec.length
    if pos != len(view):
        what = "truncated" if pos > len(view) else "followed by trailing bytes"
        raise FormatError(f"hafiza KV container {what}: expected {pos} bytes, got {len(view)}")
    if zlib.crc32(model) != header.model_crc:
        raise FormatError("hafiza KV container model block is corrupt (checksum mismatch)")
    return header, model, payloads


def _parse_body(body: memoryview) -> Header:
    try:
        dtype_code, coder_id, predictor_id, ndim = _FIXED.unpack_from(body, 0)
        if ndim > MAX_NDIM:
            raise FormatError(f"hafiza KV container header claims {ndim} dimensions")
        shape = struct.unpack_from(f"<{ndim}Q", body, _FIXED.size)
        pos = _FIXED.size + 8 * ndim
        chunk_tokens, fingerprint, digest, model_len, model_crc, n_chunks = _TAIL.unpack_from(body, pos)
        pos += _TAIL.size
        if pos + n_chunks * _CHUNK.size != len(body):
            raise FormatError("hafiza KV container header has an inconsistent chunk table")
        chunks = [ChunkRecord(*_CHUNK.unpack_from(body, pos + i * _CHUNK.size)) for i in range(n_chunks)]
    except struct.error as exc:
        raise FormatError(f"hafiza KV container header is malformed ({exc})") from exc
    if dtype_code not in BY_CODE:
        raise FormatError(f"hafiza KV container names unknown dtype code {dtype_code}")
    return Header(BY_CODE[dtype_code], tuple(shape), coder_id, predictor_id, chunk_tokens, fingerprint,
                  digest, model_crc, model_len, chunks)
