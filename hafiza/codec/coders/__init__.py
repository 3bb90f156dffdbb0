"""Lossless coders by name and by container id."""

from __future__ import annotations

from hafiza.codec.coders.base import BoundCoder, Coder
from hafiza.codec.coders.exponent import ExponentCoder
from hafiza.codec.coders.fast import FastCoder
from hafiza.codec.coders.planes import PlanesCoder
from hafiza.codec.coders.predictive import PredictiveCoder
from hafiza.codec.coders.raw import RawCoder
from hafiza.codec.coders.zstd import ZstdCoder
from hafiza.codec.errors import CodecError

CODERS: dict[str, type[Coder]] = {
    c.name: c for c in (RawCoder, ZstdCoder, ExponentCoder, PredictiveCoder, PlanesCoder, FastCoder)
}
CODER_IDS: dict[int, type[Coder]] = {c.id: c for c in CODERS.values()}


def resolve_coder(coder: str | Coder) -> Coder:
    """A coder instance from a name or an instance."""
    if isinstance(coder, Coder):
        return coder
    if coder not in CODERS:
        raise CodecError(f"unknown coder {coder!r}: choose one of {', '.join(CODERS)}")
    return CODERS[coder]()


__all__ = ["CODERS", "CODER_IDS", "BoundCoder", "Coder", "resolve_coder"]
