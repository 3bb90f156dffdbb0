"""Lossless KV coding: bit formats, chunked framing, coders (raw, zstd, planes, exponent, predictive) and predictors
(previous-token, speculative). `encode(tensor, context) -> bytes` and `decode(bytes, context) -> tensor`."""

from hafiza.codec.api import decode, encode
from hafiza.codec.context import CodecContext
from hafiza.codec.errors import (
    ChecksumError,
    CodecError,
    ContextError,
    FormatError,
    PredictionMismatchError,
    UnsupportedDtypeError,
    VersionError,
)

__all__ = [
    "ChecksumError",
    "CodecContext",
    "CodecError",
    "ContextError",
    "FormatError",
    "PredictionMismatchError",
    "UnsupportedDtypeError",
    "VersionError",
    "decode",
    "encode",
]
