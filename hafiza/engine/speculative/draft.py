"""Draft-model proposer: a small model of the target's vocabulary runs greedily ahead of each decoding request.

The draft keeps its own paged KV pool. Each request holds a few of its blocks and the tokens whose K/V they hold,
so a step only computes what changed since the last one: the tokens the target accepted past the last draft and
its own token. Drafts the target rejected are overwritten in place; only blocks of known tokens are registered
in the draft's prefix cache. When the pool runs short, the least recently drafted request gives its blocks up (it
recomputes later); a request that still does not fit gets no draft.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hafiza.cache.block_manager import BlockManager
from hafiza.cache.layout import FULL_DTYPES
from hafiza.cache.memory import kv_memory_bytes
from hafiza.cache.pool import blocks_that_fit, bytes_for_tokens, layout_for, make_kv_pool, with_blocks
from hafiza.errors import ConfigError
from hafiza.models.attention import AttentionMetadata, PrefillSpan, causal_mask
from hafiza.models.loader import LoadedModel


def check_same_vocab(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose token ids mean something else than the target's: its drafts would be noise at best
    and out of the target's range at worst."""
    t, d = target.config.vocab_size, draft.config.vocab_size
    if t != d:
        raise ConfigError(f"the draft model's vocabulary differs from the target's: the draft {draft.name} has {d} "
                          f"logits, the target {target.name} {t} logits", setting="speculative_model")
    if target.tokenizer.backend.get_vocab(with_added_tokens=True) != draft.tokenizer.backend.get_vocab(
            with_added_tokens=True):
        raise ConfigError(f"the draft model's vocabulary differs from the target's: {draft.name} and {target.name} "
                          f"both have {t} logits but map token ids to different strings", setting="speculative_model")


@dataclass
class DraftState:
    """One request's part of the draft pool: its blocks (a reference on each), the tokens whose K/V they hold, in
    order, and how many leading blocks are registered in the draft's prefix cache."""

    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    cached: int = 0


class DraftModelProposer:
    """Greedy drafts from a small model. `kv_memory` sizes its pool (default: room for `tokens` tokens);
    `kv_dtype` must be a full-precision format, as rejected drafts are overwritten in the middle of a block.
    The pool's blocks are managed by a BlockManager of their own: full blocks of known tokens are registered
    under the target's chained hashes, so a request whose prompt shares a prefix with an earlier one starts from
    the draft's cached K/V, as the target does."""

    def __init__(self, draft: LoadedModel, block_size: int = 16, kv_memory: str | int | float | None = None,
                 tokens: int = 16384, kv_dtype: str = "bf16") -> None:
        if kv_dtype not in FULL_DTYPES:
            raise ConfigError(f"the draft model's KV pool needs a full-precision dtype ({', '.join(FULL_DTYPES)}), "
                              f"got {kv_dtype}", setting="kv_dtype")
        self.model, self.block_size = draft.model, block_size
        self.device = draft.device
        self.window = draft.config.sliding_window
        self.max_len = draft.config.max_position_embeddings
        probe = layout_for(draft.config, 1, block_size, kv_dtype, draft.dtype)
        budget = bytes_for_tokens(probe, tokens) if kv_memory is None else kv_memory_bytes(kv_memory, draft.device)
        num_blocks = blocks_that_fit(budget, probe)
        if num_blocks < 1:
            raise ConfigError(f"the draft model's KV memory ({budget} bytes) holds no block of {block_size} tokens",
                              setting="speculative_model")
        self.kv = make_kv_pool(with_blocks(probe, num_blocks), draft.device)
        self.exact = FULL_DTYPES[kv_dtype] == draft.dtype
        self.blocks = BlockManager(num_blocks, block_size)
        self.states: dict[str, DraftState] = {}  # least recently drafted first

    def propose(self, tokens: list[int], limit: int, request_id: str = "", hashes: Sequence[str] = ()) -> list[int]:
        """Up to `limit` tokens the draft model predicts greedily after `tokens` (empty when the pool cannot hold
        the request). `hashes`: the chained hashes of the full blocks of `tokens` (none: no prefix caching)."""
        limit = min(limit, self.max_len - len(tokens) + 1)
        if limit <= 0 or not tokens:
            return []
        state = self.states.pop(request_id, None) or self._start(tokens, hashes)
        keep = min(len(state.tokens), len(tokens) - 1)  # the last token is always fed: its logits are needed
        if state.tokens[:keep] != tokens[:keep]:  # a rejected draft: find where it left the request's tokens
            keep = next(i for i, (have, want) in enumerate(zip(state.tokens, tokens, strict=False)) if have != want)
        if keep < state.cached * self.block_size:  # not this request's tokens: never write a registered block
            self.blocks.free(state.blocks)
            state = self._start(tokens, hashes)
            keep = len(state.tokens)
        del state.tokens[keep:]
        if not self._reserve(state, -(-(len(tokens) + limit - 1) // self.block_size)):
            self.blocks.free(state.blocks)
            return []
        logits = self._forward(state, tokens[keep:])
        end = min(len(hashes), len(tokens) // self.block_size)
        if end > state.cached:
            self.blocks.cache_chain(state.blocks, hashes, tokens, state.cached, end)
            state.cached = end
        out: list[int] = []
        while True:
            out.append(int(torch.argmax(logits)))
            if len(out) == limit:
                break
            logits = self._forward(state, out[-1:])
        self.states[request_id] = state
        return out

    def release(self, request_id: str) -> None:
        """A finished or aborted request's references go back to the pool (its registered blocks stay cached)."""
        state = self.states.pop(request_id, None)
        if state is not None:
            self.blocks.free(state.blocks)

    def check_integrity(self) -> None:
        """The block manager's invariants, plus: each block's references are the requests holding it, and each
        request holds enough blocks for its tokens, its registered ones holding its leading tokens."""
        self.blocks.check_integrity()
        held = Counter(b for s in self.states.values() for b in s.blocks)
        for block in self.blocks.blocks:
            assert block.ref_count == held[block.block_id], \
                f"draft block {block.block_id}: {block.ref_count} references, {held[block.block_id]} holders"
        bs = self.block_size
        for rid, s in self.states.items():
            assert len(s.blocks) * bs >= len(s.tokens), f"draft state {rid} outgrew its blocks"
            for i in range(s.cached):
                block = self.blocks.blocks[s.blocks[i]]  # unregistered if another block held its content first
                assert block.hash is None or block.token_ids == tuple(s.tokens[i * bs : (i + 1) * bs]), \
                    f"draft state {rid}: registered block {i} holds other tokens"

    def _start(self, tokens: list[int], hashes: Sequence[str]) -> DraftState:
        """A new request's state, holding the draft's cached prefix of `tokens`."""
        match = self.blocks.match_prefix(tokens, hashes)
        self.blocks.admit(match, 0, len(tokens) if hashes else 0)
        hit = match.num_blocks
        return DraftState(list(match.block_ids), list(tokens[: hit * self.block_size]), hit)

    def _reserve(self, state: DraftState, need: int) -> bool:
        """Give `state` exactly `need` blocks, releasing the least recently drafted requests' if the pool runs
        short; False when even that is not enough."""
        if need > self.blocks.num_blocks:
            return False
        while len(state.blocks) < need:
            short = need - len(state.blocks)
            if self.blocks.num_allocatable() >= short:
                state.blocks += self.blocks.allocate(short)
            elif self.states:
                self.blocks.free(self.states.pop(next(iter(self.states))).blocks)
            else:
                return False
        while len(state.blocks) > max(need, state.cached):
            self.blocks.free([state.blocks.pop()])
        return True

    def _forward(self, state: DraftState, ids: list[int]) -> torch.Tensor:
        """Compute `ids` after the state's tokens (their K/V land in its blocks); the last one's logits [V]."""
        bs, dev = self.block_size, self.device
        start, n = len(state.tokens), len(ids)
        ctx = start + n
        table = state.blocks[: -(-ctx // bs)]
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(start, ctx)], dtype=torch.long, device=dev)
        positions = torch.arange(start, ctx, dtype=torch.long, device=dev)
        mask = causal_mask(positions, len(table) * bs if n == 1 else ctx, self.window)
        meta = AttentionMetadata(slot_mapping=slots)
        blocks = torch.tensor(table, dtype=torch.long, device=dev)
        if n == 1:
            meta.num_decode = 1
            meta.decode_block_tables = blocks[None]
            meta.decode_mask = mask[:, None, None, :]
        elif ctx == n and not (self.window and n > self.window):
            meta.prefills.append(PrefillSpan(0, n, ctx) if self.exact else PrefillSpan(0, n, ctx, block_table=blocks))
        else:
            meta.prefills.append(PrefillSpan(0, n, ctx, block_table=blocks, mask=mask))
        hidden = self.model.forward(torch.tensor(ids, dtype=torch.long, device=dev), positions, meta, self.kv)
        state.tokens += ids
        return self.model.logits(hidden[-1:])[0]
