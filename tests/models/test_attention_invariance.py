"""Attention is batch-invariant: a token's output is bit-identical whether it is computed alone, among other query
rows, beside other sequences, against a wider (masked) key range, in a prefill span, a chunk or a decode."""

from __future__ import annotations

import pytest
import torch

from hafiza.cache.formats.full import FullPrecisionKV
from hafiza.cache.layout import FULL_DTYPES, KVLayout
from hafiza.models.attention import AttentionMetadata, PrefillSpan, invariant_attention, paged_attention

HKV, GROUP, DIM, BS = 3, 3, 64, 16


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_query_row_ignores_its_neighbours_and_masked_keys(threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(threads)
        q, k, v = (torch.randn(2, 300, DIM, generator=g) for _ in range(3))
        seen = 70
        alone = invariant_attention(q[:, :1], k[:, :seen], v[:, :seen], torch.ones(1, 1, seen, dtype=torch.bool))
        for rows in (2, 3, 5, 17, 300):
            for width in (seen, 71, 128, 300):
                visible = (torch.arange(width) < seen).expand(1, rows, width)
                got = invariant_attention(q[:, :rows], k[:, :width], v[:, :width], visible)
                assert torch.equal(got[:, :1], alone), f"{rows} rows, {width} keys"
    finally:
        torch.set_num_threads(before)


def make_pool(dtype: torch.dtype) -> tuple[FullPrecisionKV, list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pool holding one 70-token sequence (blocks 3, 7, 1, 5, 0) with random q/k/v per token."""
    kv_dtype = next(name for name, d in FULL_DTYPES.items() if d == dtype)
    pool = FullPrecisionKV(KVLayout(1, 8, BS, HKV, DIM, kv_dtype, dtype), torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    n = 70
    q = torch.randn(n, HKV * GROUP, DIM, generator=g)
    k, v = torch.randn(n, HKV, DIM, generator=g), torch.randn(n, HKV, DIM, generator=g)
    table = [3, 7, 1, 5, 0]
    slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(n)])
    pool.write(0, slots, k, v)
    return pool, table, q, k.to(dtype).float(), v.to(dtype).float()


def prefill(pool: FullPrecisionKV, table: list[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
            end: int, fresh: bool = False) -> torch.Tensor:
    """Outputs of tokens start..end-1 as one span after `start` earlier tokens."""
    n = end - start
    meta = AttentionMetadata(slot_mapping=torch.zeros(n, dtype=torch.long))
    if fresh:
        meta.prefills.append(PrefillSpan(0, n, n))
    else:
        blocks = torch.tensor(table[: -(-end // BS)])
        meta.prefills.append(PrefillSpan(0, n, end, block_table=blocks, mask=None))
    return paged_attention(0, q[start:end], k[start:end], v[start:end], pool, meta)


def decodes(pool: FullPrecisionKV, table: list[int], q: torch.Tensor, positions: list[int],
            strided: bool = False) -> torch.Tensor:
    """Several positions of the sequence as a batch of decodes (as if they were distinct sequences); `strided`
    hands their queries over as the model does, a slice of one q|k tensor."""
    width = len(table)
    meta = AttentionMetadata(slot_mapping=torch.zeros(len(positions), dtype=torch.long), num_decode=len(positions))
    meta.decode_block_tables = torch.tensor([table] * len(positions))
    mask = torch.arange(width * BS)[None, :] <= torch.tensor(positions)[:, None]
    meta.decode_mask = mask[:, None, None, :]
    qs = q[positions]
    if strided:
        qs = torch.cat([qs, torch.randn(len(positions), HKV, DIM)], dim=1)[:, : qs.shape[1]]
        assert not qs.is_contiguous()
    return paged_attention(0, qs, torch.zeros(len(positions), HKV, DIM), torch.zeros(len(positions), HKV, DIM),
                           pool, meta)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_span_chunks_and_decodes_agree_bit_for_bit(dtype: torch.dtype) -> None:
    pool, table, q, k, v = make_pool(dtype)
    whole = prefill(pool, table, q, k, v, 0, 70)
    chunked = torch.cat([prefill(pool, table, q, k, v, a, b) for a, b in [(0, 21), (21, 42), (42, 63), (63, 70)]])
    assert torch.equal(chunked, whole)
    warm_tail = prefill(pool, table, q, k, v, 32, 70)
    assert torch.equal(warm_tail, whole[32:])
    dec = decodes(pool, table, q, [69, 5, 40, 16])
    assert torch.equal(dec, whole[[69, 5, 40, 16]])
    assert torch.equal(decodes(pool, table, q, [40]), whole[40:41])
    if dtype == torch.float32:  # the fresh K/V equal the pool's only when the pool stores them exactly
        assert torch.equal(prefill(pool, table, q, k, v, 0, 70, fresh=True), whole)


def test_decodes_take_queries_as_the_model_slices_them() -> None:
    """The model hands attention q as a slice of one q|k tensor (heads strided): a batch of decodes gives the bits
    of contiguous queries."""
    pool, table, q, _, _ = make_pool(torch.float32)
    positions = [69, 5, 40]
    assert torch.equal(decodes(pool, table, q, positions, strided=True), decodes(pool, table, q, positions))


def test_matches_softmax_attention() -> None:
    pool, table, q, k, v = make_pool(torch.float32)
    got = prefill(pool, table, q, k, v, 0, 70)
    qh = q.view(70, HKV, GROUP, DIM).permute(1, 2, 0, 3)
    scores = qh @ k.permute(1, 2, 0)[:, None] / DIM**0.5
    causal = torch.ones(70, 70, dtype=torch.bool).tril()
    want = (scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v.permute(1, 0, 2)[:, None])
    torch.testing.assert_close(got, want.permute(2, 0, 1, 3).reshape(70, HKV * GROUP, DIM), rtol=1e-5, atol=1e-5)


def test_a_span_of_several_query_chunks_matches_its_decodes() -> None:
    """Past QUERY_CHUNK queries each chunk stops at its last visible key tile; every token keeps its decode's bits."""
    n = 600  # three chunks of 256 queries
    blocks = -(-n // BS)
    pool = FullPrecisionKV(KVLayout(1, blocks, BS, HKV, DIM, "fp32", torch.float32), torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    q = torch.randn(n, HKV * GROUP, DIM, generator=g)
    k, v = torch.randn(n, HKV, DIM, generator=g), torch.randn(n, HKV, DIM, generator=g)
    table = list(range(blocks))[::-1]
    pool.write(0, torch.tensor([table[p // BS] * BS + p % BS for p in range(n)]), k, v)
    meta = AttentionMetadata(slot_mapping=torch.zeros(n, dtype=torch.long))
    meta.prefills.append(PrefillSpan(0, n, n, block_table=torch.tensor(table)))
    whole = paged_attention(0, q, k, v, pool, meta)
    fresh = AttentionMetadata(slot_mapping=torch.zeros(n, dtype=torch.long), prefills=[PrefillSpan(0, n, n)])
    assert torch.equal(paged_attention(0, q, k, v, pool, fresh), whole)
    positions = [0, 63, 255, 256, 300, 511, 512, 599]
    assert torch.equal(decodes(pool, table, q, positions), whole[positions])
