"""Draft-model proposer: a small model of the target's vocabulary runs greedily ahead of each decoding request.

The draft keeps its own paged KV pool. Each request holds a few of its blocks and the tokens whose K/V they hold,
so a step only computes what changed since the last one: the tokens the target accepted past the last draft and
its own token. Drafts the target rejected are overwritten in place. When the pool runs short, the least recently
drafted request gives its blocks up (it recomputes later); a request that still does not fit gets no draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hafiza.cache.layout import FULL_DTYPES
from hafiza.cache.memory import kv_memory_bytes
from hafiza.cache.pool import blocks_that_fit, bytes_for_tokens, layout_for, make_kv_pool, with_blocks
from hafiza.errors import ConfigError
from hafiza.models.attention import AttentionMetadata, PrefillSpan
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
    """One request's part of the draft pool: its blocks, and the tokens whose K/V they hold, in order."""

    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


class DraftModelProposer:
    """Greedy drafts from a small model. `kv_memory` sizes its pool (default: room for `tokens` tokens);
    `kv_dtype` must be a full-precision format, as rejected drafts are overwritten in the middle of a block."""

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
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks))
        self.states: dict[str, DraftState] = {}  # least recently drafted first

    def propose(self, tokens: list[int], limit: int, request_id: str = "") -> list[int]:
        """Up to `limit` tokens the draft model predicts greedily after `tokens` (empty when the pool cannot hold
        the request)."""
        limit = min(limit, self.max_len - len(tokens) + 1)
        if limit <= 0 or not tokens:
            return []
        state = self.states.pop(request_id, None) or DraftState()
        keep = 0
        for have, want in zip(state.tokens, tokens[:-1], strict=False):
            if have != want:
                break
            keep += 1
        del state.tokens[keep:]
        if not self._reserve(state, -(-(len(tokens) + limit - 1) // self.block_size)):
            self.free += state.blocks
            return []
        logits = self._forward(state, tokens[keep:])
        out: list[int] = []
        while True:
            out.append(int(torch.argmax(logits)))
            if len(out) == limit:
                break
            logits = self._forward(state, out[-1:])
        self.states[request_id] = state
        return out

    def release(self, request_id: str) -> None:
        """A finished or aborted request's blocks go back to the pool."""
        state = self.states.pop(request_id, None)
        if state is not None:
            self.free += state.blocks

    def check_integrity(self) -> None:
        """Every block is free or held by exactly one request, which holds enough for its tokens."""
        held = [b for s in self.states.values() for b in s.blocks]
        assert sorted(held + self.free) == list(range(self.num_blocks)), "draft blocks leaked or shared"
        for rid, s in self.states.items():
            assert len(s.blocks) * self.block_size >= len(s.tokens), f"draft state {rid} outgrew its blocks"

    def _reserve(self, state: DraftState, need: int) -> bool:
        """Give `state` exactly `need` blocks, taking them from the least recently drafted requests if the pool
        runs short; False when even that is not enough."""
        if need > self.num_blocks:
            return False
        while len(state.blocks) < need:
            if not self.free:
                if not self.states:
                    return False
                self.free += self.states.pop(next(iter(self.states))).blocks
            state.blocks.append(self.free.pop())
        while len(state.blocks) > need:
            self.free.append(state.blocks.pop())
        return True

    def _forward(self, state: DraftState, ids: list[int]) -> torch.Tensor:
        """Compute `ids` after the state's tokens (their K/V land in its blocks); the last one's logits [V]."""
        bs, dev = self.block_size, self.device
        start, n = len(state.tokens), len(ids)
        ctx = start + n
        table = state.blocks[: -(-ctx // bs)]
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(start, ctx)], dtype=torch.long, device=dev)
        positions = torch.arange(start, ctx, dtype=torch.long, device=dev)
        keys = torch.arange(len(table) * bs if n == 1 else ctx, device=dev)
        mask = keys[None, :] <= positions[:, None]
        if self.window:
            mask &= keys[None, :] > positions[:, None] - self.window
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
