"""The fp32 CPU matmul and rms_norm are row-invariant on the default model's shapes (a token's values never depend
on its batch-mates), and the matmul still gives F.linear's values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hafiza.models.linear import cpu_fp32_linear
from hafiza.models.llama import rms_norm
from tests.support.invariance import ROW_COUNTS, assert_row_invariant

# SmolLM2-135M: qkv, o, gate_up, down, and a slice of the vocabulary head; 97 outputs split into no equal parts
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 4096), (40, 97)]


@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
def test_cpu_fp32_linear_is_row_invariant(in_features: int, out_features: int) -> None:
    g = torch.Generator().manual_seed(in_features * out_features)
    w = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    x = torch.randn(max(ROW_COUNTS) + 6, in_features, generator=g)
    assert_row_invariant(lambda rows: cpu_fp32_linear(rows, w), x)
    assert_row_invariant(lambda rows: cpu_fp32_linear(rows, w, bias), x, row_counts=(1, 3, 4, 17), threads=(2,))
    torch.testing.assert_close(cpu_fp32_linear(x, w, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_row_invariant(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    weight = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    x = torch.randn(max(ROW_COUNTS) + 6, 576, generator=g).to(dtype)
    assert_row_invariant(lambda rows: rms_norm(rows, weight, 1e-5), x)


def test_the_check_catches_a_row_dependent_op() -> None:
    """F.linear uses other kernels for one row than for many: the helper must see that."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(576, 576, generator=g)
    x = torch.randn(300, 576, generator=g)
    with pytest.raises(AssertionError, match="differ from the row computed alone"):
        assert_row_invariant(lambda rows: F.linear(rows, w), x, threads=(2,))
