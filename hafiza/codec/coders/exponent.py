"""The `exponent` coder: sign and exponent of each value entropy-coded with ANS, mantissa bits stored raw.

Per (layer, channel) the model keeps the channel's typical exponent and a class (its sign balance x its
exponent spread); values are coded as (sign, exponent - typical) with one frequency table per class, shared
by the whole tensor. Tables per channel would cost more than they save at a few thousand tokens.
"""

from __future__ import annotations

import struct

import numpy as np

from hafiza.codec import ans
from hafiza.codec.bitpack import pack, packed_size, unpack
from hafiza.codec.blob import pack_arrays, unpack_arrays
from hafiza.codec.coders.base import BoundCoder, Coder
from hafiza.codec.formats import BitFormat
from hafiza.codec.layout import ChunkRef
from hafiza.codec.predictors.base import BoundPredictor

SIGN_BUCKETS = 8
SPREAD_BUCKETS = 4
_LEN = struct.Struct("<I")


def _alphabet(fmt: BitFormat) -> int:
    """Symbols of one sign: magnitude offsets -max..+max shifted to be non-negative."""
    return 2 * (fmt.max_magnitude + 1)


def _symbols(fmt: BitFormat, bits: np.ndarray, center: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sign, mag, low = fmt.split(bits)
    r = _alphabet(fmt)
    return sign * r + (mag - center + r // 2), low


class _Bound(BoundCoder):
    def __init__(self, fmt: BitFormat, vshape: tuple[int, int, int], center: np.ndarray, classes: np.ndarray,
                 tables: list[ans.Table]) -> None:
        self.fmt, self.channels = fmt, vshape[2]
        self.center, self.tables = center, tables
        self.plan = []
        for g in range(vshape[0]):
            order = np.argsort(classes[g], kind="stable")
            ks, starts = np.unique(classes[g][order], return_index=True)
            bounds = np.append(starts[1:], order.size)[: starts.size]
            self.plan.append([(int(k), order[a:b]) for k, a, b in zip(ks, starts, bounds, strict=True)])

    def encode(self, bits: np.ndarray, ref: ChunkRef) -> bytes:
        sym, low = _symbols(self.fmt, bits, self.center[ref.group])
        enc = ans.new_encoder()
        for k, cols in reversed(self.plan[ref.group]):
            ans.encode_reverse(enc, self.tables[k], sym[:, cols])
        words = ans.finish(enc)
        return b"".join([_LEN.pack(len(words)), words, pack(low, self.fmt.mantissa)])

    def decode(self, payload: memoryview, ref: ChunkRef) -> np.ndarray:
        t = ref.stop - ref.start
        (n,) = _LEN.unpack_from(payload, 0)
        dec = ans.new_decoder(payload[4 : 4 + n])
        sym = np.empty((t, self.channels), np.int64)
        for k, cols in self.plan[ref.group]:
            sym[:, cols] = ans.decode(dec, self.tables[k], t * cols.size).reshape(t, cols.size)
        low_bytes = payload[4 + n :]
        if len(low_bytes) != packed_size(sym.size, self.fmt.mantissa):
            raise ValueError("exponent chunk has the wrong mantissa length")
        low = unpack(low_bytes, sym.size, self.fmt.mantissa).reshape(sym.shape)
        r = _alphabet(self.fmt)
        sign, off = np.divmod(sym, r)
        return self.fmt.join(sign, off - r // 2 + self.center[ref.group], low)


class ExponentCoder(Coder):
    """Sign + exponent modelled per channel class and coded with constriction's ANS; mantissa raw."""

    name, id = "exponent", 2

    def fit(self, bits: np.ndarray, fmt: BitFormat, predictor: BoundPredictor | None,
            refs: list[ChunkRef]) -> bytes:
        groups, _, channels = bits.shape
        if bits.size == 0:
            empty = np.zeros(0, np.int64)
            return pack_arrays([np.zeros(groups * channels, np.int16), np.zeros(groups * channels, np.uint8),
                                empty, empty.astype(np.uint16), empty])
        sign, mag, _ = fmt.split(bits)
        center = np.median(mag, axis=1).round().astype(np.int64)
        sb = np.minimum((sign.mean(axis=1) * SIGN_BUCKETS).astype(np.int64), SIGN_BUCKETS - 1)
        spread = np.abs(mag - center[:, None, :]).mean(axis=1)
        edges = np.quantile(spread, np.linspace(0, 1, SPREAD_BUCKETS + 1)[1:-1]) if spread.size else []
        classes = sb * SPREAD_BUCKETS + np.searchsorted(edges, spread)
        sym, _ = _symbols(fmt, bits, center[:, None, :])
        nsym = 2 * _alphabet(fmt)
        keys = (classes[:, None, :] * nsym + sym).reshape(-1)
        counts = np.bincount(keys, minlength=SIGN_BUCKETS * SPREAD_BUCKETS * nsym).reshape(-1, nsym)
        tables = [ans.Table.fit(np.arange(nsym), c) for c in counts]
        sizes, syms, cnts = ans.serialize_tables(tables)
        return pack_arrays([center.astype(np.int16).reshape(-1), classes.astype(np.uint8).reshape(-1),
                            sizes, syms.astype(np.uint16), cnts])

    def bind(self, model: bytes | memoryview, fmt: BitFormat, vshape: tuple[int, int, int],
             predictor: BoundPredictor | None) -> BoundCoder:
        center, classes, sizes, syms, cnts = unpack_arrays(model)
        groups, _, channels = vshape
        tables = ans.deserialize_tables(sizes, syms, cnts)
        center = center.astype(np.int64).reshape(groups, channels)
        classes = classes.astype(np.int64).reshape(groups, channels)
        if vshape[1] and classes.size and classes.max() >= len(tables):
            raise ValueError("exponent model names a missing table")
        return _Bound(fmt, vshape, center, classes, tables)
