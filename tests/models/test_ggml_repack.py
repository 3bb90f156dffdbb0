"""The compiled repacking (ggml_repack.py) gives bit for bit what the numpy reference path gives, for every
supported type, every weight format it builds, fused parts, and any split of the rows into jobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from hafiza.models import weights
from hafiza.models.ggml_blocks import BLOCK, SUPPORTED, unpack_rows
from hafiza.models.linear import Int4Linear, Int8Linear, int4_block_rows
from hafiza.models.weights import Source, build_linear
from tests.support.gguf_models import random_blocks

CPU = torch.device("cpu")
TYPES = sorted(SUPPORTED, key=lambda t: t.name)


def sources(raw: np.ndarray, qtype: T, k: int) -> tuple[Source, Source]:
    """(reference: numpy unpacking only, compiled: the same rows with their raw blocks)."""
    def read(a: int, b: int) -> object:
        return unpack_rows(raw[a:b], qtype, k)

    bits, group = BLOCK[qtype][2], BLOCK[qtype][3]
    ref = Source("w", (raw.shape[0], k), read, bits=bits, group=group)  # type: ignore[arg-type]
    frozen = raw.copy()
    frozen.flags.writeable = False  # as the file's memory map gives them
    fast = Source("w", (raw.shape[0], k), read, bits=bits, group=group,  # type: ignore[arg-type]
                  raw=lambda a, b: frozen[a:b], qtype=qtype)
    return ref, fast


def blocks(rows: int, k: int, qtype: T, seed: int) -> np.ndarray:
    """Random blocks with one all-zero row (scale 0: the int8 scale's lower clamp)."""
    raw = random_blocks(rows, k, qtype, np.random.default_rng(seed))
    raw[5] = 0
    return raw


@pytest.fixture(params=[1 << 21, 1 << 12], ids=["one-job", "many-jobs"])
def job_values(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(weights, "JOB_VALUES", request.param)
    return int(request.param)


def assert_same(a: object, b: object) -> None:
    assert type(a) is type(b)
    if isinstance(a, Int4Linear) and isinstance(b, Int4Linear):
        assert a.kind == b.kind
        assert torch.equal(a.packed, b.packed)
        assert torch.equal(a.scale_zero.view(torch.int16), b.scale_zero.view(torch.int16))
    elif isinstance(a, Int8Linear) and isinstance(b, Int8Linear):
        assert torch.equal(a.q, b.q)
        assert torch.equal(a.scale.view(torch.int16), b.scale.view(torch.int16))
    else:
        raise AssertionError(f"unexpected linear {type(a).__name__}")


@pytest.mark.parametrize("sizes", [(96, 32, 64), (192, 64, 128)], ids=["32-row-parts", "64-row-parts"])
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K, T.Q8_0], ids=lambda t: t.name)
def test_int4_formats_match_reference(qtype: T, sizes: tuple[int, ...], job_values: int,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: 4-bit types as int4, Q8_0 as two int4 planes; q/k/v-like fused parts of different sizes. Parts that
    are whole blocks of the running kernel's layout (64 rows under AVX-512, 32 under AVX2) take the compiled path."""
    compiled = []
    real = weights._int4_compiled
    monkeypatch.setattr(weights, "_int4_compiled", lambda *a, **kw: compiled.append(1) or real(*a, **kw))
    k = 512
    parts = [sources(blocks(rows, k, qtype, i), qtype, k) for i, rows in enumerate(sizes)]
    ref = build_linear([p[0] for p in parts], "auto", CPU)
    fast = build_linear([p[1] for p in parts], "auto", CPU)
    assert fast.kind == ("int4x2" if qtype == T.Q8_0 else "int4")
    assert_same(ref, fast)
    block = int4_block_rows()
    assert block is not None
    assert bool(compiled) == all(r % block == 0 for r in sizes)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_int8_matches_reference(qtype: T, job_values: int) -> None:
    """q8 on every type (auto's format for Q5_*, Q6_K), rows not a multiple of 32."""
    k = 512
    parts = [sources(blocks(rows, k, qtype, 10 + i), qtype, k) for i, rows in enumerate((72, 40))]
    assert_same(build_linear([p[0] for p in parts], "q8", CPU), build_linear([p[1] for p in parts], "q8", CPU))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_fp32_is_gguf_dequantize(qtype: T) -> None:
    k = 512
    raw = blocks(48, k, qtype, 20)
    w = build_linear([sources(raw, qtype, k)[1]], "fp32", CPU)
    assert np.array_equal(w.dense().numpy(), dequantize(raw, qtype).reshape(48, k))


def test_pages_of_done_rows_are_dropped() -> None:
    """Every row range is handed to `drop` once it is repacked, and the ranges cover all rows."""
    k, rows = 512, 256
    seen: list[tuple[int, int]] = []
    _, fast = sources(blocks(rows, k, T.Q4_K, 30), T.Q4_K, k)
    fast.drop = lambda a, b: seen.append((a, b))
    build_linear([fast], "auto", CPU)
    covered = np.zeros(rows, dtype=int)
    for a, b in seen:
        covered[a:b] += 1
    assert (covered == 1).all()
