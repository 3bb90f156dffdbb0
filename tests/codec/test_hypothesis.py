"""Hypothesis: tensors of odd shapes, dtypes and chunk sizes round-trip exactly through every coder."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hafiza.codec.formats import FORMATS, bits_tensor
from tests.codec.helpers import CODER_CASES, roundtrip, same_bits
from tests.support.examples import examples


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    fmt = FORMATS[draw(st.sampled_from(list(FORMATS)))]
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=4)))
    n = int(np.prod(shape)) if shape else 1
    kind = draw(st.sampled_from(["random", "constant", "normal"]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if kind == "random":
        bits = rng.integers(0, 1 << fmt.width, n, dtype=np.uint64).astype(fmt.uint)
    elif kind == "constant":
        bits = np.full(n, rng.integers(0, 1 << fmt.width), dtype=np.uint64).astype(fmt.uint)
    else:
        values = torch.from_numpy(rng.normal(0, draw(st.sampled_from([1e-3, 1.0, 50.0])), n))
        x = values.clamp(-100, 100).to(fmt.torch_dtype) if fmt.name != "int8" else values.round().clamp(
            -128, 127).to(torch.int8)
        return x.reshape(shape)
    return bits_tensor(bits.reshape(shape), fmt)


@settings(max_examples=examples(0.6), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=tensors(), case=st.sampled_from(CODER_CASES), chunk_tokens=st.sampled_from([1, 2, 3, 256]))
def test_odd_shapes_roundtrip(x: torch.Tensor, case: tuple[str, str | None], chunk_tokens: int) -> None:
    coder, predictor = case
    assert same_bits(roundtrip(x, coder, predictor, chunk_tokens), x)
