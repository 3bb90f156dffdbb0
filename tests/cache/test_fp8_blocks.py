"""fp8's per-block scale under token-by-token filling: later, larger tokens never clip and never re-round."""

from __future__ import annotations

from dataclasses import replace

import torch

from hafiza.cache.formats.fp8 import Fp8KV
from hafiza.cache.layout import KVLayout


def test_growing_block_keeps_every_token_within_bound(layout: KVLayout) -> None:
    pool = Fp8KV(replace(layout, kv_dtype="fp8"), "cpu")
    g = torch.Generator().manual_seed(1)
    ks = [torch.randn(1, 2, 64, generator=g) * (0.01 * 2**i) for i in range(16)]
    for i, k in enumerate(ks):
        pool.write(0, torch.tensor([32 + i]), k, k)
        got, _ = pool.gather(0, torch.tensor([[2]]))
        want = torch.cat(ks[: i + 1])
        err = (got[0, : i + 1] - want).abs()
        scale = pool.ks[0][2][:, None]
        assert bool((err <= want.abs() * 2**-4 + scale * 2**-9).all())
        assert bool((want.abs().amax(dim=(0, 2)) <= 448 * pool.ks[0][2]).all())


def test_growth_does_not_re_round_normal_codes(layout: KVLayout) -> None:
    pool = Fp8KV(replace(layout, kv_dtype="fp8"), "cpu")
    small = torch.linspace(-1.0, 1.0, 128).view(1, 2, 64)
    pool.write(0, torch.tensor([0]), small, small)
    before, _ = pool.gather(0, torch.tensor([[0]]))
    pool.write(0, torch.tensor([1]), small * 16, small * 16)
    after, _ = pool.gather(0, torch.tensor([[0]]))
    normal = small.abs() >= 2**-6 * float(pool.ks[0][0].max())
    assert torch.equal(after[0, 0][normal[0]], before[0, 0][normal[0]])
    assert float(after[0, 1].abs().max()) == 16.0


def test_offset_zero_write_starts_a_new_fill(layout: KVLayout) -> None:
    pool = Fp8KV(replace(layout, kv_dtype="fp8"), "cpu")
    big = torch.full((1, 2, 64), 300.0)
    pool.write(0, torch.tensor([16]), big, big)
    small = torch.full((1, 2, 64), 0.001)
    pool.write(0, torch.tensor([16]), small, small)
    assert float(pool.ks[0][1].max()) < 1e-4
    got, _ = pool.gather(0, torch.tensor([[1]]))
    assert torch.allclose(got[0, 0], small[0], rtol=2**-4)


def test_zeros_and_empty_blocks_stay_zero(layout: KVLayout) -> None:
    pool = Fp8KV(replace(layout, kv_dtype="fp8"), "cpu")
    z = torch.zeros(16, 2, 64)
    pool.write(0, torch.arange(16), z, z)
    k, v = pool.gather(0, torch.tensor([[0, 5]]))
    assert not bool(k.any()) and not bool(v.any())
