"""BlockManager: prefix hits, LRU eviction, pins with TTL, and its invariants under random operation streams."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hafiza.cache.block_manager import BlockManager, NoFreeBlocksError
from hafiza.cache.hashing import chain_hashes
from tests.support.examples import examples

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fill(bm: BlockManager, tokens: list[int]) -> list[int]:
    """Allocate and cache blocks for `tokens` as the engine does after computing them."""
    hashes = chain_hashes(tokens, BS)
    blocks = bm.allocate(-(-len(tokens) // BS))
    bm.cache_chain(blocks, hashes, tokens, 0, len(hashes))
    bm.check_integrity()
    return blocks


def hit(bm: BlockManager, tokens: list[int], hashes: list[str]) -> list[int]:
    return list(bm.match_prefix(tokens, hashes).block_ids)


def test_hit_reuses_blocks_and_is_capped_below_prompt_length() -> None:
    bm = BlockManager(8, BS)
    tokens = list(range(12))
    blocks = fill(bm, tokens)
    bm.free(blocks)
    bm.check_integrity()
    assert bm.stats().cached == 3
    # the whole prompt is cached, but the last token must be recomputed: only 2 of 3 blocks hit
    assert hit(bm, tokens, chain_hashes(tokens, BS)) == blocks[:2]
    longer = [*tokens, 99]
    assert hit(bm, longer, chain_hashes(longer, BS)) == blocks[:3]


def test_hit_is_verified_against_token_ids() -> None:
    bm = BlockManager(8, BS)
    tokens = list(range(8))
    blocks = fill(bm, tokens)
    bm.free(blocks)
    forged = [100, 101, 102, 103, 4, 5, 6, 7, 8]
    assert hit(bm, forged, chain_hashes(tokens, BS)) == []


def test_lru_evicts_least_recently_used_and_tail_first() -> None:
    bm = BlockManager(4, BS)
    a = fill(bm, list(range(8)))
    bm.free(a)
    b = fill(bm, list(range(100, 108)))
    bm.free(b)
    new = bm.allocate(1)  # evicts the LRU block: a's tail (freed tail first)
    assert new == [a[1]]
    assert bm.stats().evictions == 1
    assert hit(bm, [*range(8), 9], chain_hashes(list(range(8)), BS)) == [a[0]]
    bm.check_integrity()


def test_pinned_blocks_outlive_unpinned_until_ttl_expires() -> None:
    clock = Clock()
    bm = BlockManager(4, BS, clock=clock)
    a = fill(bm, list(range(8)))
    bm.pin(chain_hashes(list(range(8)), BS), ttl_s=300)
    bm.free(a)
    b = fill(bm, list(range(100, 108)))
    bm.free(b)
    assert bm.stats().pinned == 2
    assert sorted(bm.allocate(2)) == sorted(b)  # unpinned go first although a is older
    bm.check_integrity()
    clock.now = 301
    assert bm.stats().pinned == 0
    assert sorted(bm.allocate(2)) == sorted(a)  # expired pins are ordinary LRU blocks
    assert bm.pinned_evictions == 0
    bm.check_integrity()


def test_hit_refreshes_pin_ttl() -> None:
    clock = Clock()
    bm = BlockManager(4, BS, clock=clock)
    a = fill(bm, list(range(8)))
    bm.pin(chain_hashes(list(range(8)), BS), ttl_s=300)
    bm.free(a)
    clock.now = 200
    bm.acquire(a)
    bm.free(a)
    clock.now = 450
    assert bm.stats().pinned == 2  # refreshed at t=200, expires at 500


def test_pin_by_content_when_own_block_was_a_duplicate() -> None:
    bm = BlockManager(4, BS)
    first = fill(bm, list(range(4)))
    second = fill(bm, list(range(4)))  # same content computed again: not registered twice
    assert bm.blocks[second[0]].hash is None
    assert bm.pin(chain_hashes(list(range(4)), BS), ttl_s=60) == 1
    assert bm.blocks[first[0]].pin_expiry > 0
    bm.check_integrity()


def test_only_pinned_left_evicts_pinned_as_last_resort() -> None:
    bm = BlockManager(2, BS)
    a = fill(bm, list(range(8)))
    bm.pin(chain_hashes(list(range(8)), BS), ttl_s=3600)
    bm.free(a)
    assert len(bm.allocate(2)) == 2
    assert bm.pinned_evictions == 2
    bm.check_integrity()
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(1)


ops = st.lists(
    st.tuples(st.sampled_from(["admit", "finish", "pin", "tick", "drop"]), st.integers(0, 40), st.integers(0, 3)),
    min_size=1, max_size=60,
)


@settings(max_examples=examples(1.5), deadline=None)
@given(ops)
def test_invariants_hold_under_random_streams(stream: list[tuple[str, int, int]]) -> None:
    clock = Clock()
    bm = BlockManager(12, BS, clock=clock)
    live: list[tuple[list[int], list[int]]] = []
    prefixes = [[p * 1000 + i for i in range(40)] for p in range(4)]
    for op, n, which in stream:
        if op == "admit":
            tokens = prefixes[which][: max(1, n)]
            hashes = chain_hashes(tokens, BS)
            match = bm.match_prefix(tokens, hashes)
            reclaim = sum(1 for b in match.block_ids if bm.blocks[b].ref_count == 0)
            need = -(-len(tokens) // BS) - match.num_blocks
            fits = need <= bm.num_allocatable() - reclaim
            alloc = bm.admit(match, need, len(tokens))
            assert (alloc is not None) == fits
            if alloc is not None:
                blocks = alloc.block_ids
                bm.cache_chain(blocks, hashes, tokens, match.num_blocks, len(hashes))
                live.append((tokens, blocks))
        elif op == "finish" and live:
            bm.free(live.pop(n % len(live))[1])
        elif op == "pin" and live:
            tokens, blocks = live[n % len(live)]
            bm.pin(chain_hashes(tokens, BS), ttl_s=float(10 * (which + 1)))
        elif op == "tick":
            clock.now += n
        elif op == "drop":
            bm.drop(chain_hashes(prefixes[which], BS))
        bm.check_integrity()
        s = bm.stats()
        assert s.free + s.cached + s.in_use == s.total
    for _, blocks in live:
        bm.free(blocks)
    bm.check_integrity()
    assert bm.stats().in_use == 0


def test_cached_blocks_link_to_their_parents_and_a_broken_link_is_caught() -> None:
    bm = BlockManager(8, BS)
    tokens = list(range(12))
    blocks = fill(bm, tokens)
    hashes = chain_hashes(tokens, BS)
    links = sorted(bm.chains(), key=lambda link: link.position)
    want = [(blocks[i], hashes[i], hashes[i - 1] if i else None, i) for i in range(3)]
    assert [tuple(link) for link in links] == want
    bm.blocks[blocks[2]].position = 5
    with pytest.raises(AssertionError, match="at position 5 has its parent"):
        bm.check_integrity()


def test_admit_counts_queries_and_hits_only_when_it_fits() -> None:
    bm = BlockManager(4, BS)
    tokens = list(range(8))
    bm.free(fill(bm, tokens))
    longer = [*tokens, 50, 51, 52, 53, 54]
    match = bm.match_prefix(longer, chain_hashes(longer, BS))
    assert (match.num_blocks, match.num_unheld) == (2, 2)
    assert bm.admit(match, 3, len(longer)) is None  # 2 allocatable blocks are left once the hit is taken
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (0, 0)
    alloc = bm.admit(match, 2, len(longer))
    assert alloc is not None and list(alloc.hit) == list(match.block_ids) and len(alloc.fresh) == 2
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (13, 8)
    assert [bm.blocks[b].uses for b in alloc.hit] == [2, 2]
    bm.cache_loaded(alloc.block_ids, chain_hashes(longer, BS), longer, 2, 3)
    assert bm.prefix_cache_hits == 12 and bm.blocks[alloc.fresh[0]].parent == chain_hashes(longer, BS)[1]
    bm.check_integrity()
