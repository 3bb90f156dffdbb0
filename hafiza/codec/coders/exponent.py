"""The `exponent` coder: sign and exponent of each value entropy-coded with ANS, mantissa bits stored raw.

Per (layer, channel) the model keeps the channel's typical exponent and a class (its sign balance x its
exponent spread); values are coded as (sign, exponent - typical) with one frequency table per class, shared
by the whole tensor. Tables per channel would cost more than they save at a few thousand tokens.
Two consecutive tokens of a channel are coded as one pair symbol (their ranks in the class table, each
capped at an escape) with a per-class pair table, which captures part of the token-to-token correlation
and halves the number of ANS decodes; escaped ranks and an odd last row go through the class table.
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
PAIR = ans.MAIN + 1
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
                 tables: list[ans.Table], pairs: list[object]) -> None:
        self.fmt, self.channels = fmt, vshape[2]
        self.center, self.tables, self.pairs = center, tables, pairs
        self.plan, self.unplan = [], []
        self.center32 = center.astype(np.int32)
        for t in tables:
            t.symbols32 = t.symbols.astype(np.int32)
        for g in range(vshape[0]):
            order = np.argsort(classes[g], kind="stable")
            ks, starts = np.unique(classes[g][order], return_index=True)
            bounds = np.append(starts[1:], order.size)[: starts.size]
            self.plan.append([(int(k), order[a:b]) for k, a, b in zip(ks, starts, bounds, strict=True)])
            self.unplan.append(np.argsort(order, kind="stable"))

    def encode(self, bits: np.ndarray, ref: ChunkRef) -> bytes:
        sym, low = _symbols(self.fmt, bits, self.center[ref.group])
        enc = ans.new_encoder()
        for k, cols in reversed(self.plan[ref.group]):
            table = self.tables[k]
            if table.size <= 1:
                continue
            ranks = table.ranks(sym[:, cols].reshape(-1)).reshape(-1, cols.size)
            pairs, single, tails = _split(ranks, table.tail is not None)
            if tails.size:
                enc.encode_reverse(tails.astype(np.int32), table.tail)
            if single.size:
                enc.encode_reverse(single.astype(np.int32), table.main)
            if pairs.size:
                enc.encode_reverse(pairs.astype(np.int32), self.pairs[k])
        words = ans.finish(enc)
        return b"".join([_LEN.pack(len(words)), words, pack(low, self.fmt.mantissa)])

    def decode(self, payload: memoryview, ref: ChunkRef) -> np.ndarray:
        t = ref.stop - ref.start
        (n,) = _LEN.unpack_from(payload, 0)
        dec = ans.new_decoder(payload[4 : 4 + n])
        plan = self.plan[ref.group]
        sym = np.empty((t, self.channels), np.int32)  # columns in plan order, put back at the end
        half, col = t // 2, 0
        for k, cols in plan:
            table, block = self.tables[k], sym[:, col : col + cols.size]
            col += cols.size
            if table.size <= 1:
                block[:] = table.symbols[0] if table.size else 0
                continue
            ranks = np.empty((t, cols.size), np.int32)
            if half:
                p = dec.decode(self.pairs[k], half * cols.size).reshape(half, cols.size)
                ranks[0 : 2 * half : 2] = p >> 4
                ranks[1 : 2 * half : 2] = p & 15
            if t % 2:
                ranks[-1] = dec.decode(table.main, cols.size)
            if table.tail is not None:
                flat = ranks.reshape(-1)
                esc = np.flatnonzero(flat == ans.MAIN)
                if esc.size:
                    flat[esc] = dec.decode(table.tail, esc.size) + ans.MAIN
            np.take(table.symbols32, ranks, out=block)
        low_bytes = payload[4 + n :]
        if len(low_bytes) != packed_size(sym.size, self.fmt.mantissa):
            raise ValueError("exponent chunk has the wrong mantissa length")
        sym = sym[:, self.unplan[ref.group]]
        low = unpack(low_bytes, sym.size, self.fmt.mantissa).reshape(sym.shape)
        r = _alphabet(self.fmt)
        sign, off = np.divmod(sym, r)
        return self.fmt.join(sign, off - r // 2 + self.center32[ref.group], low)


def _split(ranks: np.ndarray, escapes: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ranks [t, channels] -> pair symbols of rows (0,1), (2,3), ..., the odd last row's capped ranks, and
    (when the table has a tail) the escaped ranks, row-major as decode meets them, minus the escape."""
    capped = np.minimum(ranks, ans.MAIN)
    half = ranks.shape[0] // 2
    pairs = (capped[0 : 2 * half : 2] * PAIR + capped[1 : 2 * half : 2]).reshape(-1)
    single = capped[2 * half :].reshape(-1)
    flat = ranks.reshape(-1)
    return pairs, single, (flat[flat >= ans.MAIN] - ans.MAIN) if escapes else flat[:0]


class ExponentCoder(Coder):
    """Sign + exponent modelled per channel class and coded with constriction's ANS; mantissa raw."""

    name, id = "exponent", 2

    def fit(self, bits: np.ndarray, fmt: BitFormat, predictor: BoundPredictor | None,
            refs: list[ChunkRef]) -> bytes:
        groups, _, channels = bits.shape
        if bits.size == 0:
            empty = np.zeros(0, np.int64)
            return pack_arrays([np.zeros(groups * channels, np.int16), np.zeros(groups * channels, np.uint8),
                                empty, empty.astype(np.uint16), empty, empty])
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
        pair_counts = np.zeros(len(tables) * PAIR * PAIR, np.int64)
        for g in range(groups):
            ranks = np.zeros(sym.shape[1:], np.int64)
            for k in np.unique(classes[g]):
                cols = np.flatnonzero(classes[g] == k)
                ranks[:, cols] = tables[k].ranks(sym[g][:, cols].reshape(-1)).reshape(-1, cols.size)
            for ref in (r for r in refs if r.group == g):
                pairs = _split(ranks[ref.start : ref.stop], False)[0].reshape(-1, channels)
                keys = classes[g][None, :] * PAIR * PAIR + pairs
                pair_counts += np.bincount(keys.reshape(-1), minlength=pair_counts.size)
        sizes, syms, cnts = ans.serialize_tables(tables)
        return pack_arrays([center.astype(np.int16).reshape(-1), classes.astype(np.uint8).reshape(-1),
                            sizes, syms.astype(np.uint16), cnts, pair_counts])

    def bind(self, model: bytes | memoryview, fmt: BitFormat, vshape: tuple[int, int, int],
             predictor: BoundPredictor | None) -> BoundCoder:
        center, classes, sizes, syms, cnts, pair_counts = unpack_arrays(model)
        groups, _, channels = vshape
        tables = ans.deserialize_tables(sizes, syms, cnts)
        if pair_counts.size != len(tables) * PAIR * PAIR:
            raise ValueError("exponent model has the wrong number of pair counts")
        per_class = pair_counts.reshape(len(tables), -1) if tables else []
        pairs = [ans.model(c if c.any() else np.ones_like(c)) for c in per_class]
        center = center.astype(np.int64).reshape(groups, channels)
        classes = classes.astype(np.int64).reshape(groups, channels)
        if vshape[1] and classes.size and classes.max() >= len(tables):
            raise ValueError("exponent model names a missing table")
        return _Bound(fmt, vshape, center, classes, tables, pairs)
