"""int4 KIVI pool: the full-precision window, per-channel key scales on sealing, adversarial inputs."""

from __future__ import annotations

from dataclasses import replace

import torch

from hafiza.cache import codes
from hafiza.cache.formats.int4 import Int4KV
from hafiza.cache.layout import KVLayout


def _seq(t: int, h: int = 2, d: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(t, h, d, generator=torch.Generator().manual_seed(seed))


def _decode(pool: Int4KV, k: torch.Tensor, v: torch.Tensor, first_slot: int = 0) -> None:
    for i in range(len(k)):
        pool.write(0, torch.tensor([first_slot + i]), k[i : i + 1], v[i : i + 1])


def test_recent_blocks_stay_full_precision_older_are_sealed(layout: KVLayout) -> None:
    pool = Int4KV(replace(layout, kv_dtype="int4"), "cpu", window_blocks=2)
    k, v = _seq(72), _seq(72, seed=1)
    _decode(pool, k, v)
    assert pool.staged_blocks() == [2, 3, 4]
    gk, gv = pool.gather(0, torch.arange(5)[None])
    assert torch.equal(gk[0, 32:72], k[32:].to(torch.bfloat16).float())
    assert torch.equal(gv[0, 32:72], v[32:].to(torch.bfloat16).float())
    sealed = k[:32].to(torch.bfloat16).float().view(2, 16, 2, 64)
    packed, s, z = codes.int4_keys_quantize(sealed, torch.ones(2, 16, dtype=torch.bool))
    want = codes.int4_keys_dequantize(packed, s, z, torch.float32).reshape(32, 2, 64)
    assert torch.equal(gk[0, :32], want)
    assert float((gk[0, :32] - k[:32]).abs().max()) > 0


def test_chunked_prefill_keeps_only_the_last_blocks(layout: KVLayout) -> None:
    pool = Int4KV(replace(layout, kv_dtype="int4"), "cpu", window_blocks=1)
    k = _seq(100)
    pool.write(0, torch.arange(100), k, k)
    assert pool.staged_blocks() == [5, 6]
    gk, _ = pool.gather(0, torch.arange(7)[None])
    assert torch.equal(gk[0, 80:100], k[80:].to(torch.bfloat16).float())
    span = (k[:80].view(5, 16, 2, 64).amax(1) - k[:80].view(5, 16, 2, 64).amin(1)).repeat_interleave(16, 0)
    assert bool(((gk[0, :80] - k[:80]).abs() <= span.view(80, 2, 64) / 30 + 0.02).all())


def test_outlier_channel_does_not_hurt_other_channels(layout: KVLayout) -> None:
    pool = Int4KV(replace(layout, kv_dtype="int4"), "cpu", window_blocks=0)
    k = _seq(32)
    k[:, :, 9] *= 1000.0
    pool.write(0, torch.arange(32), k, k)
    gk, _ = pool.gather(0, torch.tensor([[0]]))
    err = (gk[0, :16] - k[:16]).abs()
    rest = torch.cat([err[..., :9], err[..., 10:]], -1)
    span = k[:16].amax(0) - k[:16].amin(0)
    assert float(rest.max()) <= float(torch.cat([span[:, :9], span[:, 10:]], -1).max()) / 30 + 0.01
    assert float(rest.max()) < 0.5
    assert float(err[..., 9].max()) > 10 * float(rest.max())


def test_constant_and_zero_channels_and_zero_blocks_survive_sealing(layout: KVLayout) -> None:
    pool = Int4KV(replace(layout, kv_dtype="int4"), "cpu", window_blocks=0)
    k = _seq(32)
    k[:, :, 0] = 0.0
    k[:, :, 1] = -3.5
    z = torch.zeros(32, 2, 64)
    pool.write(0, torch.arange(32), k, z)
    gk, gv = pool.gather(0, torch.tensor([[0]]))
    assert torch.equal(gk[0, :, :, 0], torch.zeros(16, 2)) and torch.equal(gk[0, :, :, 1], k[:16, :, 1])
    assert not bool(gv.any())


def test_partial_block_sealed_then_reopened(layout: KVLayout) -> None:
    pool = Int4KV(replace(layout, kv_dtype="int4"), "cpu", window_blocks=0)
    a, b = _seq(10), _seq(10, seed=2)
    _decode(pool, a[:5], a[:5], first_slot=0)
    _decode(pool, b[:5], b[:5], first_slot=16)
    assert pool.staged_blocks() == [1]
    _decode(pool, a[5:], a[5:], first_slot=5)
    assert pool.staged_blocks() == [0]
    ga, _ = pool.gather(0, torch.tensor([[0]]))
    gb, _ = pool.gather(0, torch.tensor([[1]]))
    step_a = (a[:5].amax(0) - a[:5].amin(0)) / 15
    assert bool(((ga[0, :5] - a[:5]).abs() <= step_a / 2 + 0.02).all())
    assert torch.equal(ga[0, 5:10], a[5:].to(torch.bfloat16).float())
    step_b = (b[:5].amax(0) - b[:5].amin(0)) / 15
    assert bool(((gb[0, :5] - b[:5]).abs() <= step_b / 2 + 0.02).all())


def test_write_blocks_seals_and_read_blocks_round_trips(layout: KVLayout) -> None:
    pool = Int4KV(replace(layout, num_layers=2, kv_dtype="int4"), "cpu", window_blocks=1)
    data = torch.randn(2, 2, 2, 16, 2, 64)
    pool.write_blocks([3, 4], data)
    assert pool.staged_blocks() == []
    back = pool.read_blocks([3, 4])
    assert back.shape == data.shape
    assert float((back - data).abs().max()) <= float((data.amax(3) - data.amin(3)).max()) / 15


def test_bytes_and_window_accounting(layout: KVLayout) -> None:
    pool = Int4KV(replace(layout, kv_dtype="int4"), "cpu", window_blocks=2, max_seqs=4)
    assert pool.staging_blocks == 12
    assert pool.fixed_bytes == 2 * 12 * 16 * 2 * 64 * 2
    assert pool.bytes_per_token == 2 * ((32 + 4 * 64 / 16) + (32 + 4 * 64 / 32))


def test_slot_list_cache_sees_in_place_refills(layout: KVLayout) -> None:
    pool = Int4KV(replace(layout, kv_dtype="int4"), "cpu", window_blocks=0)
    slots = torch.tensor([0])
    pool.write(0, slots, _seq(1), _seq(1))
    slots[0] = 16
    pool.write(0, slots, _seq(1, seed=3), _seq(1, seed=3))
    assert pool.staged_blocks() == [1]
