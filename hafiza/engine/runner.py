"""Model runner: turns a scheduled batch into flat tensors and attention metadata, runs the forward."""

from __future__ import annotations

import math

import torch

from hafiza.cache.eviction import AttentionScores
from hafiza.cache.pool import KVPool
from hafiza.engine.scheduler import ScheduledBatch
from hafiza.models.attention import AttentionMetadata, AttentionObserver, PrefillSpan, causal_mask
from hafiza.models.llama import LlamaModel


def slot_mass(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [n, H, d], keys [S, Hkv, d], mask [n, S] (True = may attend) -> softmax(q kᵀ/√d) mass per key slot [S],
    summed over query heads and queries: what one layer's attention gave each key (H2O's score)."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).float()
    logits = torch.einsum("nhd,shd->hns", q.float(), k) / math.sqrt(q.shape[-1])
    logits = logits.masked_fill(~mask, float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(dim=(0, 1))


VERIFY_AS_DECODES = 3  # a verification of at most this many rows runs as decode rows (measured: 2 rows 17.8
# against 22.5 ms as a span, 3 rows 21.5 against 23.6, 5 rows even, 9 rows slower; default model, 200 keys)


class ModelRunner:
    """Builds inputs for one step and returns fp32 logits for the sequences that sample a token."""

    def __init__(self, model: LlamaModel, kv: KVPool, block_size: int, fresh_kv_exact: bool,
                 scores: AttentionScores | None = None) -> None:
        """`fresh_kv_exact`: the pool stores K/V exactly as computed, so a prefill without a cached prefix may
        attend to the fresh K/V instead of reading them back. `scores`: collect per-block attention mass for a
        score-based eviction policy."""
        self.model, self.kv, self.block_size = model, kv, block_size
        self.fresh_kv_exact = fresh_kv_exact
        self.scores = scores
        self.device = model.device
        self.window = model.config.sliding_window

    def _mask(self, q_pos: torch.Tensor, num_keys: int) -> torch.Tensor:
        """[len(q_pos), num_keys] True where query position may see key position (causal, sliding window)."""
        return causal_mask(q_pos, num_keys, self.window)

    def build(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """input_ids, positions, metadata, and for each sequence the flat index of its last token (or -1 when
        this step does not finish its known tokens, i.e. a non-final prefill chunk). A sequence's drafted tokens
        follow its known ones: its rows verify them."""
        bs, dev = self.block_size, self.device
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        last: list[int] = []
        num_decode = 0
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        decode_kept: list[int | None] = []
        spans: list[tuple[int, int, int, list[int], list[int] | None]] = []
        observed: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        for seq, n, kv in zip(batch.seqs, batch.num_new, batch.blocks, strict=True):
            start, end = seq.num_computed, seq.num_computed + n
            table, logical = list(kv.block_ids), list(kv.logical)
            tail = len(table) - 1 - logical[-1]  # physical index = logical block + tail, for new positions
            flat_start = len(ids)
            known = min(end, seq.num_tokens)
            ids += seq.token_ids[start:known] + seq.draft[: end - known]
            pos += range(start, end)
            slots += [table[p // bs + tail] * bs + p % bs for p in range(start, end)]
            last.append(len(ids) - 1 if end == seq.num_tokens + len(seq.draft) else -1)
            short_verify = (1 < n <= VERIFY_AS_DECODES and n - 1 == len(seq.draft) and start == seq.num_tokens - 1
                            and not kv.evicted and self.scores is None and not spans)
            if n == 1 or short_verify:  # each row attends as a decode at its own position (a short verification:
                for p in range(start + 1, end + 1):  # the bits a span gives it, less work)
                    num_decode += 1
                    kept = (len(table) - 1) * bs + (p - 1) % bs + 1
                    decode_tables.append(table)
                    decode_lens.append(p)
                    decode_kept.append(kept if kv.evicted else None)
                    if self.scores is not None:
                        observed.append((flat_start + p - start - 1, 1, torch.tensor(table, device=dev),
                                         (torch.arange(len(table) * bs, device=dev) < kept)[None]))
            else:
                spans.append((flat_start, n, end, table, logical if kv.evicted else None))
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev), num_decode=num_decode)
        if num_decode:
            width = max(len(t) for t in decode_tables)
            padded = [t + [t[0]] * (width - len(t)) for t in decode_tables]
            meta.decode_block_tables = torch.tensor(padded, dtype=torch.long, device=dev)
            q_pos = torch.tensor(decode_lens, device=dev) - 1
            mask = self._mask(q_pos, width * bs)
            for i, kept in enumerate(decode_kept):
                if kept is not None:  # evicted: the kept blocks are packed, the first `kept` slots are valid
                    mask[i] = torch.arange(width * bs, device=dev) < kept
            meta.decode_mask = mask[:, None, None, :]
        for flat_start, n, ctx, table, logical in spans:
            q_pos = positions[flat_start : flat_start + n]
            plain_causal = ctx == n and not (self.window and n > self.window)
            if logical is not None:
                offs = torch.arange(bs, device=dev)
                key_pos = (torch.tensor(logical, device=dev)[:, None] * bs + offs).reshape(-1)
                span = PrefillSpan(flat_start, n, len(table) * bs, torch.tensor(table, dtype=torch.long, device=dev),
                                   key_pos[None, :] <= q_pos[:, None])
            elif plain_causal and self.fresh_kv_exact:
                span = PrefillSpan(flat_start, n, ctx)
            else:
                span = PrefillSpan(
                    flat_start, n, ctx, block_table=torch.tensor(table[: -(-ctx // bs)], dtype=torch.long, device=dev),
                    mask=None if plain_causal else self._mask(q_pos, ctx),
                )
            meta.prefills.append(span)
            if self.scores is not None:  # a span on fresh K/V is observed too: an exact pool holds the same keys
                obs_table = span.block_table if span.block_table is not None else torch.tensor(
                    table[: -(-ctx // bs)], dtype=torch.long, device=dev)
                observed.append((flat_start, n, obs_table, span.mask if span.mask is not None
                                 else self._mask(q_pos, ctx)))
        if observed:
            meta.observer = self._observer(observed)
        return torch.tensor(ids, dtype=torch.long, device=dev), positions, meta, last

    def _observer(self, parts: list[tuple[int, int, torch.Tensor, torch.Tensor]]) -> AttentionObserver:
        """Per layer, the attention mass each block of the observed sequences received (H2O-like scores)."""
        scores = self.scores
        assert scores is not None

        def observe(layer: int, q: torch.Tensor, kv: KVPool) -> None:
            for start, n, table, mask in parts:
                keys, _ = kv.gather(layer, table[None])
                width = mask.shape[-1]
                mass = torch.zeros(keys.shape[1], dtype=torch.float32, device=q.device)  # whole blocks
                mass[:width] = slot_mass(q[start : start + n], keys[0, :width], mask)
                scores.add(table, mass, n)

        return observe

    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor | None, list[int]]:
        """Run one step; returns the logits of the sequences with last index >= 0, and those indices: for each
        such sequence 1 + len(seq.draft) rows, its last known token's and each drafted token's, in batch order."""
        logits, last, _ = self.execute_all(batch, [False] * len(batch.seqs))
        return logits, last

    def execute_all(self, batch: ScheduledBatch, every_position: list[bool],
                    ) -> tuple[torch.Tensor | None, list[int], list[torch.Tensor | None]]:
        """As `execute`, plus for each sequence with `every_position[i]` the logits [num_new, V] of every token it
        computed this step (prompt logprobs), None for the others."""
        input_ids, positions, meta, last = self.build(batch)
        hidden = self.model.forward(input_ids, positions, meta, self.kv)
        spans: list[torch.Tensor | None] = []
        start = 0
        for n, want in zip(batch.num_new, every_position, strict=True):
            spans.append(self.model.logits(hidden[start : start + n]) if want else None)
            start += n
        rows = [r for seq, i in zip(batch.seqs, last, strict=True) if i >= 0 for r in range(i - len(seq.draft), i + 1)]
        if not rows:
            return None, last, spans
        return self.model.logits(hidden[torch.tensor(rows, device=self.device)]), last, spans
