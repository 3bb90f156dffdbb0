"""Codec errors: one per failure, so a caller tells corrupt data from an unreproducible prediction."""

from __future__ import annotations

from hafiza.errors import HafizaError


class CodecError(HafizaError):
    """Base class of every error the KV codec raises."""


class FormatError(CodecError):
    """The bytes are not a hafiza KV container, or it is truncated or its header is damaged."""


class VersionError(FormatError):
    """A hafiza KV container of a format version this build does not read."""


class ChecksumError(CodecError):
    """A chunk decoded to bytes whose checksum differs from the one recorded: the stored data is corrupt."""


class PredictionMismatchError(CodecError):
    """The decoder could not reproduce the encoder's prediction bit for bit: recompute the KV from tokens."""


class ContextError(CodecError):
    """The decode context lacks what the container needs (predictor, its parameters, the same token ids)."""


class UnsupportedDtypeError(CodecError):
    """The tensor's dtype has no bit format in the codec."""
