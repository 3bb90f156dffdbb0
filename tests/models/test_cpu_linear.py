"""The row-tiled, sliced fp32 matmul gives F.linear's values (to rounding) for every row count, shape and bias."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hafiza.models.linear import ROW_TILE, cpu_fp32_linear


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows", [1, 2, 5, ROW_TILE, ROW_TILE + 1, 16, 17, 64])
@pytest.mark.parametrize("out_features", [96, 97])
def test_matches_f_linear(threads: int, rows: int, out_features: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(rows * out_features)
        x = torch.randn(rows, 40, generator=g)
        w = torch.randn(out_features, 40, generator=g)
        bias = torch.randn(out_features, generator=g)
        for b in (None, bias):
            got = cpu_fp32_linear(x, w, b)
            assert got.shape == (rows, out_features) and got.is_contiguous()
            torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)
