"""KV cache events in vLLM's format: what a router needs to know about the prefixes a worker holds.

The block manager tells a `KVEventSource` each block it registers or evicts; the source turns them into
`BlockStored` / `BlockRemoved` / `AllBlocksCleared` events at the router's block size (16 tokens, as vLLM) and
hands each to a sink (the serving side's ZMQ publisher). A pool block of P tokens (P a multiple of 16) becomes
P / 16 event blocks whose 63-bit hashes derive from the pool block's chained hash, so they chain as the pool
blocks do.

Blocks of a private cache partition (an API key's or a `cache_salt`'s) are not announced at all: a router
indexes blocks by their token ids, so announcing them would hand any subscriber another tenant's prompt.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

EVENT_BLOCK_SIZE = 16
POOL_MEDIUM = "GPU"


@dataclass(frozen=True)
class BlockStored:
    """Blocks now cached, one chain: `block_hashes[i]`'s parent is `block_hashes[i - 1]`, the first's is
    `parent_block_hash` (None at the chain's root); `token_ids` are the blocks' tokens, in order."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str

    def wire(self) -> dict[str, object]:
        """The msgpack map vLLM's tagged struct decodes to (the router reads the tag from "type")."""
        return {"type": "BlockStored", "block_hashes": list(self.block_hashes),
                "parent_block_hash": self.parent_block_hash, "token_ids": list(self.token_ids),
                "block_size": self.block_size, "lora_id": None, "medium": self.medium, "lora_name": None}


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks no longer cached on `medium`."""

    block_hashes: tuple[int, ...]
    medium: str

    def wire(self) -> dict[str, object]:
        return {"type": "BlockRemoved", "block_hashes": list(self.block_hashes), "medium": self.medium}


@dataclass(frozen=True)
class AllBlocksCleared:
    """Everything the worker announced before is gone (sent when a publisher starts)."""

    def wire(self) -> dict[str, object]:
        return {"type": "AllBlocksCleared"}


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class BlockEventSink(Protocol):
    """What the block manager reports: a block registered under a chained hash, a cached block evicted."""

    def registered(self, block_hash: str, parent: str | None, token_ids: Sequence[int],
                   partition: str | None) -> None: ...

    def evicted(self, block_hash: str) -> None: ...


def event_hash(pool_hash: str, index: int) -> int:
    """The 63-bit event hash of event block `index` inside the pool block `pool_hash` (non-negative: the router
    refuses negative hashes)."""
    digest = hashlib.sha256(f"{pool_hash}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class KVEventSource:
    """Turns the block manager's registrations and evictions into vLLM KV events for `emit`. Not thread-safe:
    the engine thread that owns the block manager calls it."""

    def __init__(self, pool_block_size: int, emit: Callable[[KVEvent], None], medium: str = POOL_MEDIUM,
                 event_block_size: int = EVENT_BLOCK_SIZE) -> None:
        if pool_block_size % event_block_size:
            raise ValueError(f"KV events are published in blocks of {event_block_size} tokens: the pool's block "
                             f"size {pool_block_size} must be a multiple of {event_block_size}")
        self.pool_block_size, self.event_block_size = pool_block_size, event_block_size
        self.per_block = pool_block_size // event_block_size
        self.emit, self.medium = emit, medium
        self.announced: dict[str, tuple[int, ...]] = {}

    def hashes_of(self, pool_hash: str) -> tuple[int, ...]:
        return tuple(event_hash(pool_hash, i) for i in range(self.per_block))

    def registered(self, block_hash: str, parent: str | None, token_ids: Sequence[int],
                   partition: str | None) -> None:
        """Announce a shared-partition block; a private partition's block is not announced."""
        if partition is not None or block_hash in self.announced:
            return
        hashes = self.hashes_of(block_hash)
        self.announced[block_hash] = hashes
        parent_hash = self.hashes_of(parent)[-1] if parent is not None else None
        self.emit(BlockStored(hashes, parent_hash, tuple(int(t) for t in token_ids), self.event_block_size,
                              self.medium))

    def evicted(self, block_hash: str) -> None:
        hashes = self.announced.pop(block_hash, None)
        if hashes is not None:
            self.emit(BlockRemoved(hashes, self.medium))

    def cleared(self) -> None:
        """Tell subscribers to forget this worker's blocks (a restart: nothing announced before is cached)."""
        self.announced.clear()
        self.emit(AllBlocksCleared())

    def stored_hashes(self) -> set[int]:
        """Every event hash announced and not removed since."""
        return {h for hashes in self.announced.values() for h in hashes}
