"""The pools behind the factory: the KVPool interface, error bounds through write/gather, capacity, errors."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hafiza.cache.errors import NonFiniteKVError
from hafiza.cache.formats.full import FullPrecisionKV
from hafiza.cache.layout import KVLayout
from hafiza.cache.pool import KVPool, blocks_that_fit, bytes_per_token, make_kv_pool, tokens_that_fit
from hafiza.errors import HafizaError

KINDS = ["fp32", "bf16", "fp16", "fp8", "int8", "int4"]
REL_BOUND = {"fp32": 0.0, "bf16": 2**-8, "fp16": 2**-11, "fp8": 2**-4, "int8": 1 / 127, "int4": 1 / 15}


def _pool(kind: str, layout: KVLayout, **options: int) -> KVPool:
    return make_kv_pool(replace(layout, kv_dtype=kind), "cpu", **options)


def _as(kind: str, layout: KVLayout) -> KVLayout:
    return replace(layout, kv_dtype=kind)


def _kv(t: int, h: int = 2, d: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, h, d, generator=g) * 2, torch.randn(t, h, d, generator=g)


@pytest.mark.parametrize("kind", KINDS)
def test_write_gather_within_bound(kind: str, layout: KVLayout) -> None:
    pool = _pool(kind, layout, window_blocks=0)
    k, v = _kv(40)
    pool.write(0, torch.arange(16, 56), k, v)
    gk, gv = pool.gather(0, torch.tensor([[1, 2, 3]]))
    assert gk.shape == (1, 48, 2, 64) and gk.dtype == layout.compute_dtype
    for got, want in ((gk[0, :40], k), (gv[0, :40], v)):
        assert float((got - want).abs().max()) <= REL_BOUND[kind] * float(want.abs().max()) * 1.01 + 1e-7


@pytest.mark.parametrize("kind", KINDS)
def test_every_format_has_the_one_pool_interface(kind: str, layout: KVLayout) -> None:
    pool = _pool(kind, layout)
    assert pool.layout == _as(kind, layout) and pool.block_size == 16 and pool.num_blocks == 8
    assert pool.kv_dtype == kind
    assert pool.bytes_per_token == bytes_per_token(_as(kind, layout))
    assert pool.bytes_per_block == int(pool.bytes_per_token * 16)
    k, v = _kv(32)
    pool.write(0, torch.arange(32), k, v)
    data = pool.read_blocks([0, 1])
    assert data.shape == (1, 2, 2, 16, 2, 64) and data.device.type == "cpu" and data.dtype == pool.block_dtype
    pool.write_blocks([4, 5], data)
    again = pool.read_blocks([4, 5])
    tol = REL_BOUND[kind] * float(data.float().abs().max()) + 1e-6
    assert float((again.float() - data.float()).abs().max()) <= tol


@pytest.mark.parametrize("kind", KINDS)
def test_gather_into_writes_what_gather_gives_head_major(kind: str, layout: KVLayout) -> None:
    """The decode attention's one-copy read: the same bits as `gather`, into padded strided views, wider
    dtypes included, and nothing outside the views touched."""
    pool = _pool(kind, layout, window_blocks=1)
    k, v = _kv(70)
    pool.write(0, torch.arange(70), k, v)
    tables = torch.tensor([[4, 0, 2], [1, 3, 1]])
    gk, gv = pool.gather(0, tables)
    for dtype in (layout.compute_dtype, torch.float64):
        keys = torch.full((2, 2, 64, 64), 7.0, dtype=dtype)
        values = torch.full((2, 2, 64, 65), 7.0, dtype=dtype)
        pool.gather_into(0, tables, keys[:, :, :48], values[:, :, :48, :64])
        assert torch.equal(keys[:, :, :48], gk.transpose(1, 2).to(dtype))
        assert torch.equal(values[:, :, :48, :64], gv.transpose(1, 2).to(dtype))
        assert bool((keys[:, :, 48:] == 7).all()) and bool((values[..., 64] == 7).all())


def test_bf16_pool_is_the_full_precision_format(layout: KVLayout) -> None:
    pool = _pool("bf16", layout)
    assert isinstance(pool, FullPrecisionKV) and pool.k[0].dtype == torch.bfloat16
    assert pool.block_dtype == torch.bfloat16 and pool.gather(0, torch.tensor([[0]]))[0].dtype == torch.float32
    same = _pool("fp32", layout)
    k, v = _kv(16)
    same.write(0, torch.arange(16), k, v)
    assert torch.equal(same.gather(0, torch.tensor([[0]]))[0][0], k)


PAYLOAD = {"fp32": ("k", "v"), "bf16": ("k", "v"), "fp16": ("k", "v"), "fp8": ("kq", "vq", "ks", "vs"),
           "int8": ("kq", "vq", "ks", "vs"), "int4": ("kq", "vq", "kscale", "kzero", "vscale", "vzero")}


@pytest.mark.parametrize("kind", KINDS)
def test_bytes_per_block_is_what_the_pool_allocates_per_block(kind: str, layout: KVLayout) -> None:
    pool = _pool(kind, replace(layout, num_layers=2))
    stored = sum(getattr(pool, name)[i][0].nbytes for name in PAYLOAD[kind] for i in range(2))
    assert stored == pool.bytes_per_block


def test_bytes_per_token_count_payload_and_scales() -> None:
    lay = KVLayout(30, 1, 16, 3, 64, "fp32", torch.float32)
    assert bytes_per_token(lay) == 2 * 30 * 3 * 64 * 4
    assert bytes_per_token(_as("bf16", lay)) == 2 * 30 * 3 * 64 * 2
    assert bytes_per_token(_as("int8", lay)) == 2 * 30 * 3 * (64 + 2)
    assert bytes_per_token(_as("fp8", lay)) == 2 * 30 * 3 * (64 + 4 / 16)
    assert bytes_per_token(_as("int4", lay)) == 30 * 3 * ((32 + 4 * 64 / 16) + (32 + 4 * 64 / 32))


def test_tokens_that_fit_orders_formats_and_counts_int4_window() -> None:
    lay = KVLayout(30, 1, 16, 3, 64, "fp32", torch.float32)
    mem = 64 << 20
    fits = {kind: tokens_that_fit(mem, _as(kind, lay)) for kind in KINDS}
    assert fits["fp32"] < fits["bf16"] < fits["int8"] < fits["fp8"] < fits["int4"]
    assert all(n % 16 == 0 for n in fits.values())
    assert tokens_that_fit(mem, _as("int4", lay), max_seqs=8) < fits["int4"]
    assert blocks_that_fit(1000, _as("bf16", lay)) == 0


def test_unknown_kind_is_a_clear_error(layout: KVLayout) -> None:
    with pytest.raises(HafizaError, match="unknown KV cache dtype 'int3'"):
        _pool("int3", layout)
    with pytest.raises(HafizaError, match="FullPrecisionKV stores fp32 or fp16 or bf16, the layout asks for int8"):
        FullPrecisionKV(_as("int8", layout), "cpu")


@pytest.mark.parametrize("kind", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_values_are_rejected(kind: str, bad: float, layout: KVLayout) -> None:
    pool = _pool(kind, layout)
    k, v = _kv(4)
    k[2, 1, 5] = bad
    with pytest.raises(NonFiniteKVError, match=r"inf or NaN .* layer\(s\) \[0\]"):
        pool.write(0, torch.arange(4), k, v)
    pool.write(0, torch.arange(4), *_kv(4))
    with pytest.raises(NonFiniteKVError, match="write_blocks"):
        pool.write_blocks([1], torch.full((1, 2, 1, 16, 2, 64), bad))


def test_non_finite_check_runs_once_per_step_at_the_last_layer(layout: KVLayout) -> None:
    pool = _pool("int8", replace(layout, num_layers=3))
    k, v = _kv(2)
    v[0, 0, 0] = float("nan")
    pool.write(0, torch.arange(2), k, v)
    pool.write(1, torch.arange(2), *_kv(2))
    with pytest.raises(NonFiniteKVError, match=r"layer\(s\) \[0\]"):
        pool.write(2, torch.arange(2), *_kv(2))
