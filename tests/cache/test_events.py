"""KVEventSource: the block manager's registrations and evictions become vLLM events at 16-token granularity."""

from __future__ import annotations

import pytest

from hafiza.cache.block_manager import BlockManager
from hafiza.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventSource, event_hash
from hafiza.cache.hashing import chain_hashes


def manager(block_size: int, num_blocks: int = 4) -> tuple[BlockManager, list[KVEvent]]:
    events: list[KVEvent] = []
    return BlockManager(num_blocks, block_size, events=KVEventSource(block_size, events.append)), events


def test_a_32_token_pool_block_is_two_chained_event_blocks_of_16() -> None:
    bm, events = manager(32)
    tokens = list(range(64))
    hashes = chain_hashes(tokens, 32)
    bm.cache_chain(bm.allocate(2), hashes, tokens, 0, 2)
    first, second = events
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.block_size == 16 and first.medium == "GPU" and first.token_ids == tuple(range(32))
    assert first.parent_block_hash is None and len(first.block_hashes) == 2
    assert second.parent_block_hash == first.block_hashes[-1] == event_hash(hashes[0], 1)
    assert all(0 <= h < 2**63 for h in (*first.block_hashes, *second.block_hashes))


def test_eviction_removes_exactly_what_was_stored() -> None:
    bm, events = manager(16, num_blocks=2)
    a = list(range(32))
    bm.free(_fill(bm, a))
    _fill(bm, [t + 100 for t in a])  # needs both blocks: evicts a's two
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    stored_a = [h for e in events[:2] for h in e.block_hashes]  # type: ignore[union-attr]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(stored_a)
    assert bm.events.stored_hashes() == {event_hash(h, 0) for h in bm.hash_to_block}  # type: ignore[union-attr]


def _fill(bm: BlockManager, tokens: list[int], partition: str | None = None) -> list[int]:
    hashes = chain_hashes(tokens, bm.block_size, (partition,))
    blocks = bm.allocate(len(hashes))
    bm.cache_chain(blocks, hashes, tokens, 0, len(hashes), partition)
    return blocks


def test_a_private_partition_is_never_announced() -> None:
    bm, events = manager(16, num_blocks=2)
    bm.free(_fill(bm, list(range(32)), partition="tenant-a"))
    _fill(bm, list(range(32, 64)), partition="tenant-b")  # evicts tenant-a's blocks
    assert events == [] and bm.evictions == 2 and len(bm.hash_to_block) == 2


def test_cleared_forgets_everything_announced() -> None:
    bm, events = manager(16)
    _fill(bm, list(range(16)))
    bm.events.cleared()  # type: ignore[union-attr]
    assert events[-1] == AllBlocksCleared() and bm.events.stored_hashes() == set()  # type: ignore[union-attr]


def test_a_pool_block_size_not_a_multiple_of_16_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        KVEventSource(8, lambda e: None)
