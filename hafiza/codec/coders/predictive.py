"""The `predictive` coder: residuals against a predictor in the ordered-integer domain, entropy-coded.

Model (per tensor): each (layer, channel) has a scale parameter `a` (2*log2 of its typical absolute error,
in half-octaves). A residual's expected size in representable steps is that error over the step size at the
predicted value, so its class is k = a - 2*exponent(prediction), clamped; without a data-independent
prediction, k = a. Each class has a shift s_k: the coarse part r >> s_k is coded with the class's frequency
table (shared by all layers and channels), the s_k fine bits are stored raw, and coarse values beyond
+-ESCAPE are escapes whose residual is stored raw. All class arithmetic is on integers, so encoder and
decoder agree bit for bit.
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

ESCAPE = 127
FINE_OFFSET = 3
_LENS = struct.Struct("<II")


def num_classes(fmt: BitFormat) -> int:
    return 2 * fmt.width + 2


def shift_of(k: np.ndarray | int) -> np.ndarray | int:
    """Raw fine bits for class k: the coarse part keeps about 2**FINE_OFFSET steps of resolution."""
    return np.maximum(np.asarray(k) // 2 - FINE_OFFSET, 0)


def _magnitude(fmt: BitFormat, predicted: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    """2 * exponent of the predicted value (subnormals as the smallest normal); zero without a prediction."""
    if predicted is None or not fmt.exponent:
        return np.zeros(shape, np.int64)
    return 2 * np.maximum(fmt.exponent_field(predicted).astype(np.int64), 1)


def _classes(fmt: BitFormat, scale: np.ndarray, predicted: np.ndarray | None, shape: tuple[int, ...]
             ) -> np.ndarray:
    return np.clip(scale - _magnitude(fmt, predicted, shape), 0, num_classes(fmt) - 1)


def _coarse(residuals: np.ndarray, shift: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Coarse symbols (ESCAPE+1 for escapes) and fine bits of residuals under per-value shifts."""
    q = residuals >> shift
    fine = (residuals - (q << shift)).astype(np.uint32)
    return np.where(np.abs(q) > ESCAPE, ESCAPE + 1, q), fine


class _Bound(BoundCoder):
    def __init__(self, fmt: BitFormat, channels: int, scale: np.ndarray, tables: list[ans.Table],
                 predictor: BoundPredictor) -> None:
        self.fmt, self.channels, self.scale = fmt, channels, scale
        self.tables, self.predictor = tables, predictor

    def _plan(self, ref: ChunkRef, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Flat positions sorted by class, the classes present and where each class starts."""
        cls = _classes(self.fmt, self.scale[ref.group], self.predictor.predicted_bits(ref), shape).reshape(-1)
        order = np.argsort(cls, kind="stable")
        ks, starts = np.unique(cls[order], return_index=True)
        return order, ks, np.append(starts, order.size)

    def encode(self, bits: np.ndarray, ref: ChunkRef) -> bytes:
        r = self.predictor.residuals(self.fmt.to_ordered(bits), ref).reshape(-1)
        order, ks, bounds = self._plan(ref, bits.shape)
        r_sorted = r[order]
        enc = ans.new_encoder()
        fines, escapes = [], []
        coarse_parts = []
        for i, k in enumerate(ks):
            part = r_sorted[bounds[i] : bounds[i + 1]]
            s = int(shift_of(k))
            q, fine = _coarse(part, np.int64(s))
            coarse_parts.append((int(k), q))
            fines.append(pack(fine, s))
            escapes.append(part[q == ESCAPE + 1])
        for k, q in reversed(coarse_parts):
            ans.encode_reverse(enc, self.tables[k], q)
        words = ans.finish(enc)
        esc = np.concatenate(escapes) if escapes else np.zeros(0, np.int64)
        half = 1 << (self.fmt.width - 1)
        esc_bytes = pack((esc + half).astype(np.uint32), self.fmt.width)
        return b"".join([_LENS.pack(len(words), esc.size), words, esc_bytes, *fines])

    def decode(self, payload: memoryview, ref: ChunkRef) -> np.ndarray:
        shape = (ref.stop - ref.start, self.channels)
        n_words, n_esc = _LENS.unpack_from(payload, 0)
        pos = _LENS.size
        dec = ans.new_decoder(payload[pos : pos + n_words])
        pos += n_words
        esc_len = packed_size(n_esc, self.fmt.width)
        half = 1 << (self.fmt.width - 1)
        esc = unpack(payload[pos : pos + esc_len], n_esc, self.fmt.width).astype(np.int64) - half
        pos += esc_len
        order, ks, bounds = self._plan(ref, shape)
        r_sorted = np.empty(order.size, np.int64)
        used_esc = 0
        for i, k in enumerate(ks):
            n = int(bounds[i + 1] - bounds[i])
            q = ans.decode(dec, self.tables[int(k)], n)
            s = int(shift_of(k))
            flen = packed_size(n, s)
            fine = unpack(payload[pos : pos + flen], n, s).astype(np.int64)
            pos += flen
            part = (q << s) + fine
            is_esc = np.flatnonzero(q == ESCAPE + 1)
            part[is_esc] = esc[used_esc : used_esc + is_esc.size]
            used_esc += is_esc.size
            r_sorted[bounds[i] : bounds[i + 1]] = part
        if pos != len(payload) or used_esc != n_esc:
            raise ValueError("predictive chunk has inconsistent section lengths")
        r = np.empty_like(r_sorted)
        r[order] = r_sorted
        ordered = self.predictor.reconstruct(r.reshape(shape), ref)
        return self.fmt.from_ordered(ordered)


class PredictiveCoder(Coder):
    """Residuals against a predictor, coded by class (per-channel scale x predicted magnitude) with ANS."""

    name, id, needs_predictor = "predictive", 3, True

    def fit(self, bits: np.ndarray, fmt: BitFormat, predictor: BoundPredictor | None,
            refs: list[ChunkRef]) -> bytes:
        assert predictor is not None
        groups, tokens, channels = bits.shape
        nsym = 2 * ESCAPE + 3
        counts = np.zeros(num_classes(fmt) * nsym, np.int64)
        log_err = np.zeros((groups, channels))
        residuals = []
        for ref in refs:
            chunk = bits[ref.group, ref.start : ref.stop]
            r = predictor.residuals(fmt.to_ordered(chunk), ref)
            mag = _magnitude(fmt, predictor.predicted_bits(ref), chunk.shape)
            log_err[ref.group] += (2 * np.log2(np.abs(r) + 1.0) + mag).sum(axis=0)
            residuals.append((ref, r, mag))
        scale = np.round(log_err / max(tokens, 1)).astype(np.int64)
        for ref, r, mag in residuals:
            cls = np.clip(scale[ref.group] - mag, 0, num_classes(fmt) - 1)
            q, _ = _coarse(r, shift_of(cls))
            keys = cls.reshape(-1) * nsym + q.reshape(-1) + ESCAPE + 1
            counts += np.bincount(keys, minlength=counts.size)
        tables = [ans.Table.fit(np.arange(nsym) - ESCAPE - 1, c) for c in counts.reshape(-1, nsym)]
        sizes, syms, cnts = ans.serialize_tables(tables)
        return pack_arrays([scale.astype(np.int16).reshape(-1), sizes, syms.astype(np.int16), cnts])

    def bind(self, model: bytes | memoryview, fmt: BitFormat, vshape: tuple[int, int, int],
             predictor: BoundPredictor | None) -> BoundCoder:
        assert predictor is not None
        scale, sizes, syms, cnts = unpack_arrays(model)
        tables = ans.deserialize_tables(sizes, syms, cnts)
        if len(tables) != num_classes(fmt):
            raise ValueError("predictive model has the wrong number of class tables")
        return _Bound(fmt, vshape[2], scale.astype(np.int64).reshape(vshape[0], vshape[2]), tables, predictor)
