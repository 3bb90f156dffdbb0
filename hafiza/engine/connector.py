"""KVConnector: how the engine reaches KV tiers below its working pool (host RAM, disk, Redis).

The engine calls `save` once for every block that becomes full (write-through, so another instance can hit it
at once), and on admission asks `lookup` how many blocks past its own prefix hit a tier can supply, then `load`s
them into freshly allocated blocks. Implementations keep the engine thread's share of the work small (copy
the block out, queue the rest) and never raise into the engine: a failed load just means recompute.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class ExternalHit:
    """What the tiers can supply: `num_blocks` consecutive blocks, whether loading beats recomputing, why,
    and how many blocks each tier supplied."""

    num_blocks: int = 0
    load: bool = False
    reason: str = ""
    per_tier: dict[str, int] = field(default_factory=dict)


class KVConnector(ABC):
    """The engine's side of the tiered store. Called only from the engine thread."""

    @abstractmethod
    def save(self, block_hash: str, block_id: int) -> None:
        """A block just became full and cached in the pool under `block_hash`: write it down the tiers."""

    @abstractmethod
    def lookup(self, hashes: Sequence[str]) -> ExternalHit:
        """How many leading blocks of `hashes` the tiers hold, and whether loading them beats recompute."""

    @abstractmethod
    def load(self, hashes: Sequence[str], block_ids: Sequence[int]) -> int:
        """Fill pool blocks `block_ids` with the blocks named by `hashes`; returns how many leading blocks
        were loaded and verified (the rest are recomputed)."""

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:  # noqa: B027 - optional hook
        """Measured prefill speed, for the load-versus-recompute cost model."""

    def flush(self, timeout_s: float = 30.0) -> None:  # noqa: B027 - optional hook
        """Finish pending writes (graceful shutdown)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and threads."""
