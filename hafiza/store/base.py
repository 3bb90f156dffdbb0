"""The one interface every storage tier implements (host RAM, local disk, Redis/Valkey).

Contract, checked by tests/store/test_contract.py for every back end:
- Keys are non-empty strings (see `keys.block_key`); values are opaque bytes (the caller encodes KV blocks
  with the codec). `get` returns exactly the bytes given to `put`, or None; never damaged bytes.
- No method raises for an I/O, connection or integrity failure: `put`/`delete` return False, `get` returns
  None, `contains` returns False, and the failure is counted in `stats().errors`. The caller recomputes.
- `put` returns True when the value is stored. An entry may vanish at any later time (LRU eviction under the
  byte cap, Redis expiry, another instance's delete); callers treat every tier as a cache.
- `ttl_s` is how long the entry is worth keeping (the API's cache TTL). Redis applies it as the key's expiry,
  since the shared tier has no LRU of ours; RAM and disk keep entries until LRU eviction.
- `stats()` counts `get` outcomes as hits/misses (`contains` counts nothing) and `put` outcomes as
  puts/rejected (refused without error: too large, tier disabled or degraded).
- Every method is thread-safe. After `close()`, operations behave as on an empty, disabled tier.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from types import TracebackType

from hafiza.store.keys import block_key
from hafiza.store.stats import StoreStats

__all__ = ["KVStore", "StoreStats", "block_key"]


class KVStore(ABC):
    """A byte store below the working KV pool; see the module docstring for the contract."""

    name: str = "store"
    kind: str = "abstract"

    @abstractmethod
    def put(self, key: str, value: bytes, ttl_s: float | None = None) -> bool:
        """Store `value` under `key`, replacing any previous value; False when not stored."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value stored under `key`, or None (absent, expired, damaged or tier unavailable)."""

    @abstractmethod
    def contains(self, key: str) -> bool:
        """Whether `get(key)` would probably return a value (cheap; no payload transfer)."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove `key`; True when an entry was removed."""

    @abstractmethod
    def stats(self) -> StoreStats:
        """A snapshot of this tier's gauges and counters."""

    @abstractmethod
    def clear(self) -> None:
        """Remove every entry of this store (Redis: only keys under its prefix)."""

    def close(self) -> None:  # noqa: B027 (optional hook: most tiers hold something to release)
        """Release files, locks and connections."""

    @property
    def enabled(self) -> bool:
        """False once the tier has switched itself off (e.g. a full or unwritable disk)."""
        return True

    @property
    def degraded(self) -> bool:
        """True while the tier's backing service is unreachable (operations answer as misses)."""
        return False

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """`get` for each key; back ends with round trips override this to batch them."""
        return [self.get(k) for k in keys]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """`contains` for each key; back ends with round trips override this to batch them."""
        return [self.contains(k) for k in keys]

    def __enter__(self) -> KVStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
