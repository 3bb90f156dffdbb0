"""Explainable cache misses: compare a prompt with recent ones and say why its prefix was (not) reused.

The result becomes the `x-hafiza-cache` response header, e.g.
`partial; reused=1200; prompt=1262; reason=diverged; at=message[0]; offset=1203; similar=msg_1f…`,
and a log line for every request that is not a full hit.

An explanation only ever compares a prompt with earlier prompts of the same cache partition (API key and
`cache_salt`), since it can reveal how far those prompts agree with it. By default it names no other request and
no token offset (`at=`, `offset=`, `similar=` are left out of the header; the server log keeps them):
`details=True` (the `explain_details` setting) puts them in the header too.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from hafiza.server.prompt import Prompt

log = logging.getLogger("hafiza.server.cache")


@dataclass
class Explanation:
    """Why a request's prompt was or was not served from the prefix cache."""

    status: str
    reused: int
    prompt: int
    reason: str | None = None
    at: str | None = None
    offset: int | None = None
    similar: str | None = None
    ignored_breakpoints: int = 0
    min_cache_tokens: int = 0
    show_details: bool = True

    def header(self, details: bool | None = None) -> str:
        """The header value; `at`, `offset` and `similar` only with `details` (default: `show_details`)."""
        details = self.show_details if details is None else details
        parts = [self.status, f"reused={self.reused}", f"prompt={self.prompt}"]
        if self.reason:
            parts.append(f"reason={self.reason}")
        if details and self.at is not None:
            parts += [f"at={self.at}", f"offset={self.offset}"]
        if details and self.similar:
            parts.append(f"similar={self.similar}")
        if self.ignored_breakpoints:
            parts.append(f"ignored_breakpoints={self.ignored_breakpoints}")
            parts.append(f"min_cache_tokens={self.min_cache_tokens}")
        return "; ".join(parts)


@dataclass
class _Seen:
    ids: np.ndarray
    hashes: dict[str, str]
    computed_at: float
    partition: str | None = None
    tools: tuple[str, ...] = ()


class CacheExplainer:
    """Remembers the last `history` prompts (token ids, per-turn hashes, partition) to explain the next ones;
    `details` puts the other request's id and the token offset in the header (the log always has them)."""

    def __init__(self, block_size: int, history: int = 256, details: bool = False) -> None:
        self.block_size, self.history, self.details = block_size, history, details
        self.seen: OrderedDict[str, _Seen] = OrderedDict()

    def explain(self, request_id: str, prompt: Prompt, cached: int, arrival: float, computed_at: float,
                ignored_breakpoints: int = 0, min_cache_tokens: int = 0, partition: str | None = None
                ) -> Explanation:
        """Explain `cached` reused tokens of `prompt` (times on the engine's monotonic clock: when the request
        arrived, when its prompt was fully computed) against earlier prompts of `partition`, then remember it."""
        ids = np.asarray(prompt.ids, dtype=np.int32)
        n, bs = len(ids), self.block_size
        reusable = (n - 1) // bs * bs
        status = "hit" if reusable and cached >= reusable else ("partial" if cached else "miss")
        exp = Explanation(status, cached, n, ignored_breakpoints=ignored_breakpoints,
                          min_cache_tokens=min_cache_tokens, show_details=self.details)
        if status != "hit":
            self._diagnose(exp, ids, prompt, cached, reusable, arrival, partition)
        self._remember(request_id, _Seen(ids, prompt.segment_hashes, computed_at, partition, tuple(prompt.tool_keys)))
        if status != "hit":
            log.info("cache %s for %s: %s", status, request_id, exp.header(details=True))
        return exp

    def _diagnose(self, exp: Explanation, ids: np.ndarray, prompt: Prompt, cached: int, reusable: int,
                  arrival: float, partition: str | None) -> None:
        if reusable == 0:
            exp.reason = "short"
            return
        best: tuple[int, int] | None = None
        best_id = ""
        for rid, seen in self.seen.items():
            if seen.partition != partition:
                continue
            common = _common_prefix(ids, seen.ids)
            shared = sum(1 for k, v in prompt.segment_hashes.items() if seen.hashes.get(k) == v)
            key = (common // self.block_size, shared)
            if (common >= self.block_size or shared) and (best is None or key >= best):
                best, best_id = key, rid
        if best is None:
            exp.reason = "no_history"
            return
        seen = self.seen[best_id]
        common = _common_prefix(ids, seen.ids)
        exp.similar, exp.offset, exp.at = best_id, common, prompt.segment_at(common)
        expected = min(common, len(ids) - 1) // self.block_size * self.block_size
        if cached < expected:
            exp.reason = "in_flight" if arrival < seen.computed_at else "evicted"
        elif common >= len(seen.ids):
            exp.reason = "extended"
        elif seen.tools != tuple(prompt.tool_keys) and sorted(seen.tools) == sorted(prompt.tool_keys):
            exp.reason = "tool_order"  # the same tools in another order: the prefix differs from the first moved one
        else:
            exp.reason = "diverged"

    def _remember(self, request_id: str, new: _Seen) -> None:
        for rid, seen in list(self.seen.items()):
            if seen.partition == new.partition and len(seen.ids) == len(new.ids) and np.array_equal(seen.ids, new.ids):
                new.computed_at = min(new.computed_at, seen.computed_at)
                del self.seen[rid]
        self.seen[request_id] = new
        while len(self.seen) > self.history:
            self.seen.popitem(last=False)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n
