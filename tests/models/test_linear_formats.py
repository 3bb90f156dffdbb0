"""Each weight format computes what its repacked numbers say, and every row depends only on its own input row."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from hafiza.models.ggml_blocks import BLOCK, unpack_rows
from hafiza.models.linear import (
    ConcatLinear,
    DenseLinear,
    GroupedRows,
    Int4Linear,
    Int8Linear,
    RefinedHead,
    _pack_int4_cpu_torch,
    int4_block_rows,
    pack_int4_cpu_numpy,
)
from hafiza.models.weights import Source, build_linear, build_rows, two_plane_parts
from tests.support.gguf_models import random_blocks

CPU = torch.device("cpu")
BF16_ULP = 2.0**-8  # relative rounding bound of one bf16 value


def gguf_source(raw: np.ndarray, qtype: T, k: int) -> Source:
    return Source("w", (raw.shape[0], k), lambda a, b: unpack_rows(raw[a:b], qtype, k), bits=BLOCK[qtype][2],
                  group=BLOCK[qtype][3])


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K], ids=lambda t: t.name)
def test_int4_repack_of_4bit_blocks(qtype: T) -> None:
    """4-bit blocks keep their integers; only scale and zero round to bf16, and the kernel computes with them."""
    n, k = 96, 512
    raw = random_blocks(n, k, qtype, np.random.default_rng(3))
    exact = torch.from_numpy(dequantize(raw, qtype).reshape(n, k))
    lin = build_linear([gguf_source(raw, qtype, k)], "auto", CPU)
    assert isinstance(lin, Int4Linear)
    g = unpack_rows(raw, qtype, k)
    sz = lin.scale_zero.float()  # [G, N, 2]
    scale, zero = sz[..., 0].t().repeat_interleave(32, 1), sz[..., 1].t().repeat_interleave(32, 1)
    rebuilt = (torch.from_numpy(g.q).float() - 8) * scale + zero
    bound = ((torch.from_numpy(g.q).float() - 8).abs() * scale.abs() + zero.abs()) * BF16_ULP
    assert bool(((rebuilt - exact).abs() <= bound + 1e-12).all())
    x = torch.randn(5, k)
    ref = x.bfloat16().float() @ rebuilt.t()
    assert float((lin(x) - ref).abs().max() / ref.abs().max()) < 2 * BF16_ULP


@pytest.mark.parametrize(("qtype", "mode"), [(T.Q8_0, "q8"), (T.Q5_0, "auto"), (T.Q5_K, "auto"), (T.Q6_K, "auto")],
                         ids=lambda t: getattr(t, "name", t))
def test_int8_requantization_error_is_bounded(qtype: T, mode: str) -> None:
    """Wider formats go to int8 per output row: each value moves by at most half the row's step (+ bf16 scale)."""
    n, k = 64, 512
    raw = random_blocks(n, k, qtype, np.random.default_rng(4))
    exact = torch.from_numpy(dequantize(raw, qtype).reshape(n, k))
    lin = build_linear([gguf_source(raw, qtype, k)], mode, CPU)
    assert isinstance(lin, Int8Linear)
    step = exact.abs().amax(dim=1, keepdim=True) / 127
    assert bool(((lin.dense() - exact).abs() <= step * (0.5 + 128 * BF16_ULP)).all())


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q5_0, T.Q5_1], ids=lambda t: t.name)
def test_two_int4_planes_hold_wider_blocks_exactly(qtype: T) -> None:
    """[hi | lo] int4 planes rebuild 32-wide 5..8-bit blocks exactly in fp32; `auto` runs Q8_0 that way, and the
    kernel's product differs from bf16 inputs times those weights only by bf16 rounding of scales and output."""
    n, k = 64, 256
    raw = random_blocks(n, k, qtype, np.random.default_rng(9))
    exact = torch.from_numpy(dequantize(raw, qtype).reshape(n, k))
    q, scale, zero = two_plane_parts(unpack_rows(raw, qtype, k))
    assert q.shape == (n, 2 * k) and int(q.max()) <= 15
    planes = (torch.from_numpy(q).float().view(n, -1, 32) - 8) * torch.from_numpy(scale)[..., None] \
        + torch.from_numpy(zero)[..., None]
    planes = planes.view(n, 2 * k)
    assert torch.equal(planes[:, :k] + planes[:, k:], exact)
    if qtype != T.Q8_0:
        return
    lin = build_linear([gguf_source(raw, qtype, k)], "auto", CPU)
    assert isinstance(lin, Int4Linear) and lin.kind == "int4x2" and lin.in_features == k
    x = torch.randn(5, k)
    ref = x.bfloat16().float() @ exact.t()
    assert float((lin(x) - ref).abs().max() / ref.abs().max()) < 4 * BF16_ULP


@pytest.mark.parametrize("seed", range(20))
def test_refined_head_top_logits_are_fp32(seed: int) -> None:
    """The property the head keeps: the k logits the kernel ranks highest in each row become the fp32 products of
    the exact rows, every other logit keeps the kernel's value. It does not promise the exact top k (an unrefined
    logit may outrank a refined one); the greedy token is the exact model's whenever the exact argmax is among the
    kernel's top k, which every seeded draw here checks."""
    v, k = 512, 256
    raw = random_blocks(v, k, T.Q8_0, np.random.default_rng(10 + seed))
    src = gguf_source(raw, T.Q8_0, k)
    src.raw, src.qtype = (lambda a, b: raw[a:b]), T.Q8_0
    rows = build_rows(src, "auto", torch.float32, CPU)
    base = build_linear([src], "auto", CPU)
    head = RefinedHead(base, rows, top=8)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(seed))
    exact = x @ torch.from_numpy(dequantize(raw, T.Q8_0).reshape(v, k)).t()
    got, approx = head(x), base(x)
    refined = approx.topk(8, dim=1).indices
    torch.testing.assert_close(got.gather(1, refined), exact.gather(1, refined), rtol=1e-5, atol=1e-5)
    rest = torch.ones_like(got, dtype=torch.bool).scatter_(1, refined, False)
    assert torch.equal(got[rest], approx[rest])
    assert bool((refined == exact.argmax(1, keepdim=True)).any(1).all()), "exact argmax outside the kernel's top 8"
    assert torch.equal(got.argmax(1), exact.argmax(1))


def test_q4_requantizes_wider_formats_group_wise() -> None:
    """--weights q4 on Q8_0 blocks: asymmetric int4 per 32 values, error at most half a step (+ bf16)."""
    n, k = 64, 256
    raw = random_blocks(n, k, T.Q8_0, np.random.default_rng(5))
    exact = torch.from_numpy(dequantize(raw, T.Q8_0).reshape(n, k))
    lin = build_linear([gguf_source(raw, T.Q8_0, k)], "q4", CPU)
    assert isinstance(lin, Int4Linear)
    g = exact.view(n, -1, 32)
    step = ((g.amax(-1) - g.amin(-1)) / 15).repeat_interleave(32, 1)
    err = (lin.dense() - exact).abs()
    assert bool((err <= 0.5 * step + 4 * BF16_ULP * exact.abs().amax()).all())


def test_embedding_rows_are_gguf_values_exactly() -> None:
    for qtype in (T.Q8_0, T.Q4_1, T.Q4_K, T.Q6_K):
        raw = random_blocks(40, 256, qtype, np.random.default_rng(6))
        rows = build_rows(gguf_source(raw, qtype, 256), "auto", torch.float32, CPU)
        assert isinstance(rows, GroupedRows)
        ids = torch.tensor([3, 0, 39, 3])
        expect = torch.from_numpy(dequantize(raw, qtype).reshape(40, 256))[ids]
        assert torch.equal(rows(ids), expect), qtype.name


@pytest.mark.parametrize("rows", [4096 + 96, 4096 + 64, 160, 48, 16])
def test_numpy_int4_packing_is_torchs_layout(rows: int) -> None:
    """The running kernel's layout (64-row blocks under AVX-512, 32 under AVX2, pairs in a last partial block) is
    the one the numpy packer writes; tests/models/test_isa.py runs this again under AVX2."""
    q = np.random.default_rng(7).integers(0, 16, size=(rows, 192), dtype=np.uint8)
    torch_packed = _pack_int4_cpu_torch(q)
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q.astype(np.int32)), 1)
    assert torch.equal(torch_packed, whole)  # 4096-row chunks concatenate
    block = int4_block_rows()
    assert block == (64 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 32)
    assert np.array_equal(pack_int4_cpu_numpy(q, block), whole.numpy())


def _formats(n: int, k: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    q = torch.randint(0, 16, (n, k), generator=g).to(torch.uint8).numpy()
    scale = (torch.rand(n, k // 32, generator=g) * 0.01).numpy()
    zero = (torch.randn(n, k // 32, generator=g) * 0.01).numpy()
    int4 = Int4Linear.from_ints(q, scale, zero, CPU)
    int8 = Int8Linear.quantize(w, CPU)
    two = Int4Linear.from_ints(np.concatenate([q, q[:, ::-1]], axis=1), np.concatenate([scale, scale], axis=1),
                               np.concatenate([zero, zero], axis=1), CPU, planes=2)
    embed = GroupedRows(q.astype(np.int8), scale, zero, 32, torch.float32, CPU)
    return {
        "int4x2": two,
        "refined-head": RefinedHead(int4, embed, top=4),
        "fp32": DenseLinear(w),
        "bf16": DenseLinear(w.bfloat16()),
        "int4": int4,
        "int8": int8,
        "int4+int8": ConcatLinear([int4, int8]),
    }


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(576, 576), (3072, 576), (576, 1536), (960, 576)])
def test_rows_are_independent_of_the_batch(shape: tuple[int, int], threads: int) -> None:
    """Row i of every format's output is bit-identical whatever the number of rows and where the row sits."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n, k = shape
        x = torch.randn(70, k, generator=torch.Generator().manual_seed(1))
        for name, lin in _formats(n, k).items():
            full = lin(x)  # type: ignore[operator]
            assert full.shape == (70, 2 * n if "+" in name else n) and full.dtype == torch.float32
            for rows in (1, 2, 3, 5, 8, 9, 16, 17, 33):
                assert torch.equal(lin(x[:rows]), full[:rows]), f"{name}: {rows} rows"  # type: ignore[operator]
                assert torch.equal(lin(x[20 : 20 + rows]), full[20 : 20 + rows]), f"{name}: rows at 20"  # type: ignore[operator]
    finally:
        torch.set_num_threads(before)


def test_fp32_values_stay_f_linear_values() -> None:
    """The padded fp32 path is still F.linear's arithmetic (the logits tests compare it with transformers)."""
    w, x = torch.randn(96, 40), torch.randn(7, 40)
    torch.testing.assert_close(DenseLinear(w)(x), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_embedding_rows_independent_of_batch() -> None:
    raw = random_blocks(64, 256, T.Q8_0, np.random.default_rng(8))
    rows = build_rows(gguf_source(raw, T.Q8_0, 256), "auto", torch.float32, CPU)
    ids = torch.arange(64)
    full = rows(ids)
    assert torch.equal(rows(ids[5:6]), full[5:6])
