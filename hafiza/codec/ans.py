"""Frequency tables and vectorised ANS coding of symbol arrays through constriction.

A table lists the symbols seen, most frequent first. Coding goes by rank: ranks below 15 are coded with a
16-entry categorical (15 + escape), the rest with a second categorical. constriction's categorical decoder
searches its CDF, so a small first alphabet keeps the common case fast.
"""

from __future__ import annotations

from dataclasses import dataclass

import constriction
import numpy as np

MAIN = 15
_Categorical = constriction.stream.model.Categorical


def model(counts: np.ndarray) -> object:
    """A constriction categorical from integer counts (zero counts still get the smallest probability)."""
    return _Categorical(counts.astype(np.float64), perfect=False)


@dataclass
class Table:
    """Sorted (descending count) symbols and their counts, plus the constriction models built from them."""

    symbols: np.ndarray
    counts: np.ndarray

    def __post_init__(self) -> None:
        n = self.symbols.size
        self.size = n
        self._by_symbol = np.argsort(self.symbols, kind="stable")
        self._sorted = self.symbols[self._by_symbol]
        if n > MAIN + 1:
            self.main = model(np.append(self.counts[:MAIN], self.counts[MAIN:].sum()))
            self.tail = model(self.counts[MAIN:])
        else:
            self.main = model(self.counts) if n > 1 else None
            self.tail = None

    @classmethod
    def fit(cls, symbols: np.ndarray, counts: np.ndarray) -> Table:
        """From observed symbols and counts (any order); zero counts are dropped."""
        keep = counts > 0
        s, c = symbols[keep], counts[keep]
        order = np.lexsort((s, -c))
        return cls(s[order].astype(np.int64), c[order].astype(np.int64))

    def ranks(self, symbols: np.ndarray) -> np.ndarray:
        """Rank of each symbol in this table (all must occur in it)."""
        pos = np.searchsorted(self._sorted, symbols)
        return self._by_symbol[np.minimum(pos, self.size - 1)].astype(np.int32)


def encode_reverse(coder: object, table: Table, symbols: np.ndarray) -> None:
    """Push `symbols` so that decode() pops them back in order (call in reverse order across calls)."""
    if table.size <= 1 or symbols.size == 0:
        return
    r = table.ranks(symbols.reshape(-1))
    if table.tail is not None:
        rest = r[r >= MAIN] - MAIN
        if rest.size:
            coder.encode_reverse(rest.astype(np.int32), table.tail)
        r = np.minimum(r, MAIN)
    coder.encode_reverse(r.astype(np.int32), table.main)


def decode(coder: object, table: Table, count: int) -> np.ndarray:
    """Pop `count` symbols coded by encode_reverse with the same table."""
    if count == 0:
        return np.zeros(0, np.int64)
    if table.size <= 1:
        return np.full(count, table.symbols[0] if table.size else 0, np.int64)
    r = coder.decode(table.main, count).astype(np.int64)
    if table.tail is not None:
        esc = np.flatnonzero(r == MAIN)
        if esc.size:
            r[esc] = coder.decode(table.tail, esc.size).astype(np.int64) + MAIN
    return table.symbols[r]


def new_encoder() -> object:
    return constriction.stream.stack.AnsCoder()


def finish(coder: object) -> bytes:
    """The compressed words of an encoder as little-endian bytes."""
    return coder.get_compressed().astype("<u4").tobytes()


def new_decoder(data: bytes | memoryview) -> object:
    words = np.frombuffer(data, "<u4").astype(np.uint32)
    return constriction.stream.stack.AnsCoder(words) if words.size else constriction.stream.stack.AnsCoder()


def serialize_tables(tables: list[Table]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tables as (sizes, symbols, counts) arrays, for a model block."""
    sizes = np.array([t.size for t in tables], np.int64)
    syms = np.concatenate([t.symbols for t in tables]) if tables else np.zeros(0, np.int64)
    cnts = np.concatenate([t.counts for t in tables]) if tables else np.zeros(0, np.int64)
    return sizes, syms, cnts


def deserialize_tables(sizes: np.ndarray, symbols: np.ndarray, counts: np.ndarray) -> list[Table]:
    ends = np.cumsum(sizes)
    starts = ends - sizes
    return [Table(symbols[a:b].astype(np.int64), counts[a:b].astype(np.int64))
            for a, b in zip(starts, ends, strict=True)]
