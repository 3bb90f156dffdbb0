"""KVConnector: how the engine reaches KV tiers below its working pool (host RAM, disk, Redis).

The engine calls `save` once for every block that becomes full (write-through, so another instance can hit it
at once), with all the tiers need to know of it (`SavedBlock`), so the connector reads nothing of the engine's.
On admission it asks `lookup` which blocks past its own prefix a tier can supply (a `TierHit`), and
hands that same `TierHit` to `load` with freshly allocated blocks; `load` says what arrived (a `TierLoad`). The
two calls are paired by that value, not by state kept in the connector. Implementations keep the engine
thread's share of the work small (copy the block out, queue the rest) and never raise into the engine: a failed
load just means recompute.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


class TierDecision(enum.StrEnum):
    """The tiers' answer for an admission (the `decision` of `x-hafiza-tiers`)."""

    LOAD = "load"  # loading the blocks beats recomputing them
    RECOMPUTE = "recompute"  # the tiers hold blocks, recomputing them is faster
    MISS = "miss"  # the tiers hold none of the next blocks
    NONE = "none"  # the tiers were not asked


@dataclass(frozen=True)
class SavedBlock:
    """A block that just became full and cached in the pool: its hash and pool block, the request's tokens
    (`token_ids[:end]` run from the prompt's start to this block's end; a predictor reruns them; read them during
    `save`, they keep growing), and the TTL of the API cache breakpoint covering it (None: not pinned)."""

    block_hash: str
    block_id: int
    token_ids: Sequence[int]
    end: int
    pin_ttl_s: float | None = None

    def tokens(self) -> list[int] | None:
        """The tokens up to this block's end (None if the request no longer holds them all)."""
        return list(self.token_ids[: self.end]) if len(self.token_ids) >= self.end else None


@dataclass(frozen=True)
class TierHit:
    """What `lookup` found: the leading `hashes` some tier holds, `sources[i]` the tier holding block i, whether
    loading them beats recomputing (`load`) and why (`reason`, starting "load:", "recompute:" or "miss:")."""

    hashes: tuple[str, ...] = ()
    sources: tuple[str, ...] = ()
    load: bool = False
    reason: str = ""

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)

    @property
    def decision(self) -> TierDecision:
        """Load, recompute (the tiers hold blocks, recomputing them is faster) or miss (they hold none)."""
        return TierDecision.LOAD if self.load else TierDecision.RECOMPUTE if self.hashes else TierDecision.MISS


@dataclass(frozen=True)
class TierLoad:
    """What `load` wrote into the pool: the hit's first `num_blocks` blocks, `sources[i]` the tier block i came
    from; `note` says why fewer blocks arrived than the hit promised (empty when all did)."""

    sources: tuple[str, ...] = ()
    note: str = ""

    @property
    def num_blocks(self) -> int:
        return len(self.sources)


@dataclass(frozen=True)
class TierOutcome:
    """How a request's first admission found its prompt's K/V, kept on its Sequence for the request's output (the
    `x-hafiza-tiers` header, usage's cached tokens).

    `pool_tokens` came from the working pool's prefix cache; `loaded_tokens` (`loaded_blocks` blocks) were loaded
    from the tiers below it, `per_tier` maps a tier's name to the tokens it supplied. `decision` is the tiers'
    answer: "load", "recompute" (they hold more blocks but recomputing them is faster), "miss" (they hold none of
    the next blocks) or "none" (they were not asked). `reason` is the cost model's explanation, or for "none" why
    the tiers were not asked."""

    decision: TierDecision = TierDecision.NONE
    reason: str = ""
    pool_tokens: int = 0
    loaded_blocks: int = 0
    loaded_tokens: int = 0
    per_tier: Mapping[str, int] = field(default_factory=dict)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose K/V was not computed for this request (pool plus tiers)."""
        return self.pool_tokens + self.loaded_tokens


class KVConnector(ABC):
    """The engine's side of the tiered store. Called only from the engine thread."""

    @abstractmethod
    def save(self, block: SavedBlock) -> None:
        """A block just became full and cached in the pool: write it down the tiers."""

    @abstractmethod
    def lookup(self, hashes: Sequence[str], token_ids: Sequence[int] = (), first_block: int = 0) -> TierHit:
        """How many leading blocks of `hashes` the tiers hold, and whether loading them beats recompute.
        `hashes` are blocks `first_block`… of the prompt `token_ids` (a codec may rerun a predictor on them)."""

    @abstractmethod
    def load(self, hit: TierHit, block_ids: Sequence[int]) -> TierLoad:
        """Fill pool blocks `block_ids` with the first `len(block_ids)` blocks of `hit` (from this connector's
        `lookup`); says how many leading blocks were loaded and verified (the rest are recomputed)."""

    def serving(self, busy: bool) -> None:  # noqa: B027 - optional hook
        """A forward is about to run (True), or nothing is left to run (False): background work waits for False."""

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:  # noqa: B027 - optional hook
        """Measured prefill speed, for the load-versus-recompute cost model."""

    def flush(self, timeout_s: float = 30.0) -> None:  # noqa: B027 - optional hook
        """Finish pending writes (graceful shutdown)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and threads."""
