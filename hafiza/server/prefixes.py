"""Which prefix chains the KV pool holds, listed from the block manager's chain links.

Every cached block knows its parent (the previous block's hash) and its position in its chain, so the cached
prefixes form a forest: a block no cached block continues is a leaf, and the chain of a leaf is the path from it
up through its cached ancestors. A chain whose first block is not at position 0 has lost an ancestor to
eviction: a prefix hit cannot reach its blocks (they are "stranded" until evicted themselves). Reads (`snapshot`,
`drop`) run on the engine thread, so they see the block states of one moment; nothing is learned from watching
requests, so a request admitted and finished within one step is listed like any other.

`requests` of a chain is how many requests registered or hit its blocks past the part it shares with other
listed chains (the block manager's per-block `uses`: a request preempted and admitted again counts twice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hafiza.cache.block_manager import ChainLink
from hafiza.engine.engine import LLMEngine

PREVIEW_TOKENS = 24


@dataclass
class _Chain:
    """One cached chain, first block first. `reachable` of its blocks a prefix hit can use (all of them, or none
    when its first block's parent was evicted); its first `shared` blocks another listed chain holds too."""

    links: list[ChainLink]
    reachable: int
    shared: int = 0

    @property
    def leaf(self) -> ChainLink:
        return self.links[-1]

    @property
    def num_blocks(self) -> int:
        """Blocks from the root to the leaf, resident or not."""
        return self.leaf.position + 1


class PrefixIndex:
    """The cached prefixes of one engine's pool; see the module docstring. `capacity` bounds the preview cache."""

    def __init__(self, engine: LLMEngine, capacity: int = 512) -> None:
        self.engine, self.capacity = engine, capacity
        self.block_size = engine.layout.block_size
        self._previews: dict[tuple[str, int], tuple[str, str]] = {}

    # -- reading (engine thread) --------------------------------------------------------------------------

    def _chains(self) -> list[_Chain]:
        """Every leaf's chain, largest first (reachable blocks, then resident blocks, then most recently used),
        with the number of its leading blocks that another listed chain shares."""
        links = self.engine.blocks.chains()
        by_hash = {link.hash: link for link in links}
        continued = {link.parent for link in links if link.parent is not None}
        out: list[_Chain] = []
        for leaf in links:
            if leaf.hash in continued:
                continue
            path = [leaf]
            while path[-1].parent is not None and path[-1].parent in by_hash:
                path.append(by_hash[path[-1].parent])
            path.reverse()
            out.append(_Chain(path, len(path) if path[0].position == 0 else 0))
        uses: dict[str, int] = {}
        for c in out:
            for link in c.links:
                uses[link.hash] = uses.get(link.hash, 0) + 1
        for c in out:
            c.shared = next((i for i, link in enumerate(c.links) if uses[link.hash] < 2), len(c.links))
        out.sort(key=lambda c: (c.reachable, len(c.links), self._last_used(c)), reverse=True)
        return out

    def _own(self, c: _Chain) -> list[ChainLink]:
        """The chain's blocks past its shared part (its leaf when all are shared)."""
        return c.links[c.shared :] or c.links[-1:]

    def _last_used(self, c: _Chain) -> float:
        blocks = self.engine.blocks.blocks
        return max(blocks[link.block_id].last_used for link in self._own(c))

    def snapshot(self, limit: int = 20) -> dict[str, Any]:
        """The `limit` largest cached prefixes (by reachable tokens) with their pins, TTLs and previews."""
        chains = self._chains()
        manager = self.engine.blocks
        blocks, now, bs = manager.blocks, manager.clock(), self.block_size
        attributed = {link.block_id for c in chains for link in c.links}
        cached_ids = {b.block_id for b in blocks if b.hash is not None}
        rows = []
        for c in chains[:limit]:
            held = [blocks[link.block_id] for link in c.links]
            pinned = [b for b in held if b.pin_expiry > now]
            head, tail = self._preview(c)
            rows.append({
                "id": c.leaf.hash,
                "tokens": c.reachable * bs,
                "blocks": c.num_blocks,
                "resident_blocks": len(c.links),
                "stranded_blocks": len(c.links) - c.reachable,
                "shared_tokens": min(c.shared, c.reachable) * bs,
                "in_use_blocks": sum(b.ref_count > 0 for b in held),
                "pinned_blocks": len(pinned),
                "pin_ttl_s": max((b.pin_ttl for b in pinned), default=None),
                "ttl_left_s": min((b.pin_expiry - now for b in pinned), default=None),
                "requests": max(blocks[link.block_id].uses for link in self._own(c)),
                "idle_s": max(0.0, now - self._last_used(c)),
                "head": head,
                "tail": tail,
                "bytes": len(c.links) * self.engine.bytes_per_block,
            })
        return {"prefixes": rows, "count": len(chains), "unattributed_cached_blocks": len(cached_ids - attributed)}

    def _preview(self, c: _Chain) -> tuple[str, str]:
        """Readable start and end of a chain's reachable tokens (cached per chain and length)."""
        key = (c.leaf.hash, c.reachable)
        if key not in self._previews:
            blocks = self.engine.blocks.blocks
            ids = [t for link in c.links[: c.reachable] for t in blocks[link.block_id].token_ids]
            decode = self.engine.tokenizer.decode
            head = decode(ids[:PREVIEW_TOKENS])
            tail = decode(ids[-PREVIEW_TOKENS:]) if len(ids) > 2 * PREVIEW_TOKENS else ""
            if len(self._previews) > 4 * self.capacity:
                self._previews.clear()
            self._previews[key] = (head, tail)
        return self._previews[key]

    # -- acting (engine thread) ---------------------------------------------------------------------------

    def drop(self, prefix_id: str, include_shared: bool = False) -> tuple[dict[str, Any], list[str]]:
        """Evict the blocks of one listed prefix that no other listed prefix shares (all of them with
        `include_shared`); blocks a running request holds are left alone. Returns the report and the block hashes
        dropped (evicted or not, for the store tiers). Raises KeyError if the prefix is not listed."""
        c = {c.leaf.hash: c for c in self._chains()}.get(prefix_id)
        if c is None:
            raise KeyError(prefix_id)
        start = 0 if include_shared else min(c.shared, len(c.links))
        blocks = self.engine.blocks.blocks
        own = c.links[start:]
        in_use = sum(1 for link in own if blocks[link.block_id].ref_count > 0)
        dropped = self.engine.blocks.drop([link.hash for link in own])
        report = {"id": prefix_id, "dropped_blocks": dropped, "dropped_tokens": dropped * self.block_size,
                  "kept_in_use_blocks": in_use, "kept_shared_blocks": start}
        return report, [link.hash for link in own]
