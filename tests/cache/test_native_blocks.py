"""Native block form (read_native / write_native) of every pool format: a bit-exact round trip of the stored
codes and scales, and the same gather output on the pool they are written into."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hafiza.cache.errors import KVDtypeError, NonFiniteKVError
from hafiza.cache.formats.int4 import Int4KV
from hafiza.cache.formats.native import NativeBlocks, stack
from hafiza.cache.layout import KVLayout
from hafiza.cache.pool import KVPool, make_kv_pool
from tests.support.examples import examples

KINDS = ["fp32", "bf16", "fp16", "fp8", "int8", "int4"]
LAYOUT = KVLayout(num_layers=2, num_blocks=6, block_size=8, num_kv_heads=2, head_dim=32, kv_dtype="fp32",
                  compute_dtype=torch.float32)
CODE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5}


def _pool(kind: str, compute: torch.dtype = torch.float32) -> KVPool:
    return make_kv_pool(replace(LAYOUT, kv_dtype=kind, compute_dtype=compute), "cpu", window_blocks=0)


def _fill(pool: KVPool, tokens: int, seed: int, scale: float) -> None:
    """Write `tokens` tokens into every layer, a few at a time (fp8 grows scales, int4 seals blocks)."""
    g = torch.Generator().manual_seed(seed)
    lay = pool.layout
    pos = 0
    while pos < tokens:
        step = min(tokens - pos, 1 + int(torch.randint(0, 11, (1,), generator=g)))
        slots = torch.arange(pos, pos + step)
        for layer in range(lay.num_layers):
            k = torch.randn(step, lay.num_kv_heads, lay.head_dim, generator=g) * scale
            v = torch.randn(step, lay.num_kv_heads, lay.head_dim, generator=g) * scale * (1 + pos)
            pool.write(layer, slots, k, v)
        pos += step


def _gathered(pool: KVPool, ids: list[int]) -> list[torch.Tensor]:
    table = torch.tensor([ids])
    return [t for layer in range(pool.layout.num_layers) for t in pool.gather(layer, table)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=examples(0.08), deadline=None)
@given(tokens=st.integers(8, 48), seed=st.integers(0, 2**16), scale=st.sampled_from([1e-3, 1.0, 40.0]),
       dst=st.permutations(range(6)))
def test_native_round_trip_is_bit_exact(kind: str, tokens: int, seed: int, scale: float, dst: list[int]) -> None:
    src = _pool(kind)
    _fill(src, tokens, seed, scale)
    full = tokens // LAYOUT.block_size
    ids = list(range(full))
    native = src.read_native(ids)
    assert native.kv_dtype == kind and native.num_blocks == full
    assert native.nbytes == pytest.approx(native.codes.numel() * CODE_BYTES[kind] * (2 if kind == "int4" else 1)
                                          + sum(t.numel() * t.element_size() for t in native.scales.values()))
    dst_ids = dst[:full]
    out = _pool(kind)
    out.write_native(dst_ids, native)
    again = out.read_native(dst_ids)
    assert again.equal(native)
    staged = set(src.staged_blocks()) if isinstance(src, Int4KV) else set()
    sealed_src = [b for b in ids if b not in staged]
    sealed_dst = [dst_ids[b] for b in sealed_src]
    if sealed_src:
        for a, b in zip(_gathered(src, sealed_src), _gathered(out, sealed_dst), strict=True):
            assert torch.equal(_bits(a), _bits(b))
    third = _pool(kind)
    third.write_native(ids, again)
    for a, b in zip(_gathered(out, dst_ids), _gathered(third, ids), strict=True):
        assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("kind", ["fp8", "int8", "int4"])
def test_quantised_codes_travel_at_their_own_width(kind: str) -> None:
    pool = _pool(kind, torch.bfloat16)
    _fill(pool, 24, 1, 1.0)
    native = pool.read_native([0, 1])
    values = LAYOUT.num_layers * 2 * 2 * LAYOUT.block_size * LAYOUT.num_kv_heads * LAYOUT.head_dim
    assert native.codes.numel() * native.codes.element_size() == values * CODE_BYTES[kind]
    assert native.nbytes == 2 * pool.bytes_per_block
    assert native.nbytes < values * 2 * 0.7  # against bf16 blocks from read_blocks


def test_int4_staged_block_is_read_sealed_and_the_pool_keeps_it_staged() -> None:
    pool = _pool("int4")
    _fill(pool, 16, 2, 1.0)
    staged = pool.staged_blocks()
    assert staged == [1]
    before = _gathered(pool, [1])
    native = pool.read_native([1])
    assert pool.staged_blocks() == [1]
    assert all(torch.equal(a, b) for a, b in zip(before, _gathered(pool, [1]), strict=True))
    other = _pool("int4")
    other.write_blocks([3], pool.read_blocks([1]))  # what a loader stored before: re-sealed values
    assert other.read_native([3]).equal(native)


def test_split_and_stack_are_inverse() -> None:
    pool = _pool("int8")
    _fill(pool, 40, 3, 1.0)
    native = pool.read_native([0, 2, 4])
    assert stack([native.block(i) for i in range(3)]).equal(native)


def test_write_native_refuses_another_format_or_shape() -> None:
    int8, fp8 = _pool("int8"), _pool("fp8")
    _fill(int8, 16, 4, 1.0)
    native = int8.read_native([0])
    with pytest.raises(KVDtypeError, match="native blocks are int8, the pool stores fp8"):
        fp8.write_native([0], native)
    with pytest.raises(KVDtypeError, match="part 'codes' is"):
        int8.write_native([0, 1], native)
    bad = NativeBlocks("int8", native.codes, {"k_scale": native.scales["k_scale"]})
    with pytest.raises(KVDtypeError, match="need parts"):
        int8.write_native([0], bad)
    scales = dict(native.scales) | {"v_scale": torch.full_like(native.scales["v_scale"], float("inf"))}
    with pytest.raises(NonFiniteKVError):
        int8.write_native([1], NativeBlocks("int8", native.codes, scales))
