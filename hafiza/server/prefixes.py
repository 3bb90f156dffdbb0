"""Which prefix chains the KV pool holds: an index of block-hash chains learned from the engine's requests.

The block manager knows each cached block's hash but not its parent, so it cannot list "cached prefixes". This
index watches the engine (as an `AsyncEngine` step listener, on the engine thread): every request it sees in the
waiting queue or the running batch contributes its chain of block hashes. A chain that extends a remembered one
(the next turn of a conversation, a reply growing block by block) replaces it. Reads (`snapshot`, `drop`) also
run on the engine thread, so they see the block states of one moment.

A request admitted and finished within a single engine step (e.g. `max_tokens` 0 or 1 on a short prompt) is never
seen by a listener; its cached blocks are reported as unattributed rather than guessed.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from hafiza.engine.engine import LLMEngine, RequestOutput

PREVIEW_TOKENS = 24


@dataclass
class _Chain:
    """One remembered chain: its block hashes from the root, how many requests used it, when last used."""

    hashes: list[str]
    requests: int = 1
    first_seen: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.time)


@dataclass
class _Resident:
    """Where a chain stands in the pool right now."""

    chain: _Chain
    block_ids: list[int | None]
    reachable: int
    shared: int = 0

    @property
    def resident(self) -> int:
        return sum(b is not None for b in self.block_ids)


class PrefixIndex:
    """Remembers up to `capacity` chains (least recently used dropped first); see the module docstring."""

    def __init__(self, engine: LLMEngine, capacity: int = 512) -> None:
        self.engine, self.capacity = engine, capacity
        self.block_size = engine.layout.block_size
        self.chains: OrderedDict[str, _Chain] = OrderedDict()
        self._live: dict[str, str] = {}
        self._previews: dict[tuple[str, int], tuple[str, str]] = {}

    # -- learning (engine thread) -------------------------------------------------------------------------

    def observe(self, outputs: list[RequestOutput]) -> None:
        """Step listener: record the chain of every admitted request whose chain grew since the last step."""
        sched = self.engine.scheduler
        seen: set[str] = set()
        for seq in (*sched.running, *sched.waiting):
            seen.add(seq.request_id)
            hashes = seq.block_hashes
            if hashes and self._live.get(seq.request_id) != hashes[-1]:
                self._record(seq.request_id, list(hashes))
        for rid in [r for r in self._live if r not in seen]:
            del self._live[rid]

    def _record(self, request_id: str, hashes: list[str]) -> None:
        """Remember `hashes`, absorbing the remembered chains it extends (their request counts carry over)."""
        now = time.time()
        leaf, previous = hashes[-1], self._live.get(request_id)
        self._live[request_id] = leaf
        chain = self.chains.get(leaf)
        if chain is None:
            absorbed = {h: self.chains.pop(h) for h in hashes[:-1] if h in self.chains}
            chain = _Chain(hashes, requests=sum(a.requests for a in absorbed.values()) + (previous not in absorbed),
                           first_seen=min((a.first_seen for a in absorbed.values()), default=now))
            self.chains[leaf] = chain
        elif previous is None:
            chain.requests += 1
        chain.last_seen = now
        self.chains.move_to_end(leaf)
        while len(self.chains) > self.capacity:
            self.chains.popitem(last=False)

    # -- reading (engine thread) --------------------------------------------------------------------------

    def _residents(self) -> list[_Resident]:
        """Every remembered chain holding blocks no larger chain holds, largest first (the others are forgotten),
        with the number of its leading blocks that another listed chain shares."""
        hash_to_block, blocks = self.engine.blocks.hash_to_block, self.engine.blocks.blocks
        out: list[_Resident] = []
        for leaf, chain in list(self.chains.items()):
            ids: list[int | None] = []
            for h in chain.hashes:
                bid = hash_to_block.get(h)
                ids.append(bid if bid is not None and blocks[bid].hash == h else None)
            reachable = next((i for i, b in enumerate(ids) if b is None), len(ids))
            if not any(b is not None for b in ids):
                del self.chains[leaf]
                continue
            out.append(_Resident(chain, ids, reachable))
        interior: dict[str, _Resident] = {}
        for r in sorted(out, key=lambda r: len(r.chain.hashes)):  # longest last: hashes map to maximal chains
            for h in r.chain.hashes[:-1]:
                interior[h] = r
        merged = []
        for r in out:
            container = interior.get(r.chain.hashes[-1])
            if container is not None and container is not r:
                container.chain.requests += r.chain.requests
                container.chain.last_seen = max(container.chain.last_seen, r.chain.last_seen)
                self.chains.pop(r.chain.hashes[-1], None)
            else:
                merged.append(r)
        merged.sort(key=lambda r: (r.reachable, r.resident, r.chain.last_seen), reverse=True)
        covered: set[str] = set()
        kept = []
        for r in merged:  # a chain whose blocks all belong to larger listed chains adds nothing: forget it
            own = {h for h, b in zip(r.chain.hashes, r.block_ids, strict=True) if b is not None} - covered
            if not own:
                self.chains.pop(r.chain.hashes[-1], None)
                continue
            covered |= own
            kept.append(r)
        uses: dict[str, int] = {}
        for r in kept:
            for h, b in zip(r.chain.hashes, r.block_ids, strict=True):
                if b is not None:
                    uses[h] = uses.get(h, 0) + 1
        for r in kept:
            r.shared = next((i for i, h in enumerate(r.chain.hashes) if uses.get(h, 0) < 2), len(r.chain.hashes))
        return kept

    def snapshot(self, limit: int = 20) -> dict[str, Any]:
        """The `limit` largest cached prefixes (by reachable tokens) with their pins, TTLs and previews."""
        residents = self._residents()
        blocks, now, bs = self.engine.blocks.blocks, self.engine.blocks.clock(), self.block_size
        block_bytes = self.engine.bytes_per_block
        attributed: set[int] = set()
        for r in residents:
            attributed.update(b for b in r.block_ids if b is not None)
        cached_ids = {b.block_id for b in blocks if b.hash is not None}
        rows = []
        for r in residents[:limit]:
            held = [blocks[b] for b in r.block_ids if b is not None]
            pinned = [b for b in held if b.pin_expiry > now]
            head, tail = self._preview(r)
            rows.append({
                "id": r.chain.hashes[-1],
                "tokens": r.reachable * bs,
                "blocks": len(r.chain.hashes),
                "resident_blocks": r.resident,
                "stranded_blocks": r.resident - r.reachable,
                "shared_tokens": min(r.shared, r.reachable) * bs,
                "in_use_blocks": sum(b.ref_count > 0 for b in held),
                "pinned_blocks": len(pinned),
                "pin_ttl_s": max((b.pin_ttl for b in pinned), default=None),
                "ttl_left_s": min((b.pin_expiry - now for b in pinned), default=None),
                "requests": r.chain.requests,
                "idle_s": max(0.0, time.time() - r.chain.last_seen),
                "head": head,
                "tail": tail,
                "bytes": r.resident * block_bytes,
            })
        return {"prefixes": rows, "count": len(residents),
                "unattributed_cached_blocks": len(cached_ids - attributed)}

    def _preview(self, r: _Resident) -> tuple[str, str]:
        """Readable start and end of a chain's reachable tokens (cached per chain and length)."""
        key = (r.chain.hashes[-1], r.reachable)
        if key not in self._previews:
            blocks = self.engine.blocks.blocks
            ids = [t for b in r.block_ids[: r.reachable] if b is not None for t in blocks[b].token_ids]
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
        residents = {r.chain.hashes[-1]: r for r in self._residents()}
        r = residents.get(prefix_id)
        if r is None:
            raise KeyError(prefix_id)
        start = 0 if include_shared else min(r.shared, len(r.chain.hashes))
        blocks = self.engine.blocks.blocks
        own = list(zip(r.chain.hashes[start:], r.block_ids[start:], strict=True))
        in_use = sum(1 for _, b in own if b is not None and blocks[b].ref_count > 0)
        dropped = self.engine.blocks.drop([h for h, b in own if b is not None])
        if not in_use:
            self.chains.pop(prefix_id, None)  # what is left of it is listed under the prefixes sharing it
        report = {"id": prefix_id, "dropped_blocks": dropped, "dropped_tokens": dropped * self.block_size,
                  "kept_in_use_blocks": in_use, "kept_shared_blocks": sum(b is not None for b in r.block_ids[:start])}
        return report, [h for h, _ in own]
