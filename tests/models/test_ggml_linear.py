"""ggml's kernels on GGUF blocks: gguf's own values within the 8-bit activation's error, row-invariant, and the
model loading through them when asked for by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from hafiza.errors import ConfigError
from hafiza.models import kernel_choice
from hafiza.models.ggml_linear import GGMLLinear, available

pytestmark = pytest.mark.skipif(not available(), reason="ggml-python not installed or CPU lacks AVX2/FMA/F16C")

TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]


def blocks(w: np.ndarray, qtype: T) -> np.ndarray:
    """w [N, K] as `qtype`'s blocks: gguf's quantizer where it has one, ggml's own for the K types."""
    try:
        return quantize(w, qtype)
    except NotImplementedError:
        import ctypes

        import ggml

        n, k = w.shape
        out = np.empty((n, ggml.ggml_row_size(int(qtype), k)), dtype=np.uint8)
        src = np.ascontiguousarray(w, dtype=np.float32)
        ggml.ggml_quantize_chunk(int(qtype), src.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), out.ctypes.data,
                                 0, n, k, None)
        return out


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matches_gguf_dequantize_within_activation_rounding(qtype: T) -> None:
    rng = np.random.default_rng(int(qtype))
    raw = blocks(rng.standard_normal((64, 256)).astype(np.float32), qtype)
    lin = GGMLLinear(raw, qtype, 256)
    x = torch.from_numpy(rng.standard_normal((5, 256)).astype(np.float32))
    ref = x @ torch.from_numpy(dequantize(raw, qtype)).T
    err = (lin(x) - ref).abs().max().item()
    assert err <= 0.02 * ref.abs().max().item(), f"{qtype.name}: error {err} against max {ref.abs().max()}"
    assert torch.equal(lin.dense(), torch.from_numpy(dequantize(raw, qtype)))


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q6_K], ids=lambda t: t.name)
def test_rows_do_not_depend_on_batch_or_threads(qtype: T) -> None:
    rng = np.random.default_rng(1)
    lin = GGMLLinear(blocks(rng.standard_normal((96, 512)).astype(np.float32), qtype), qtype, 512)
    x = torch.from_numpy(rng.standard_normal((9, 512)).astype(np.float32))
    alone = torch.cat([lin(x[i : i + 1]) for i in range(9)])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = lin(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(alone, together)
    assert torch.equal(lin(x[3:7]), alone[3:7])
    assert lin(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_refuses_a_type_it_has_no_kernel_for() -> None:
    with pytest.raises(ValueError, match="ggml kernels take"):
        GGMLLinear(np.zeros((4, 64), dtype=np.uint8), T.IQ4_NL, 128)


def test_model_loads_through_ggml_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from hafiza.models import load_model

    monkeypatch.setenv("HAFIZA_CPU_KERNEL", "ggml")
    kernel_choice.cpu_kernel.cache_clear()
    try:
        loaded = load_model(device="cpu", weights="auto")
        assert "ggml-Q4_1" in loaded.model.weights.formats()
        assert "ggml integer-dot" in kernel_choice.describe()
    finally:
        kernel_choice.cpu_kernel.cache_clear()
    lw = loaded.model.layers[0]
    x = torch.randn(2, lw.gate_up.in_features, generator=torch.Generator().manual_seed(0))
    ref = x @ lw.gate_up.dense().T
    assert (lw.gate_up(x) - ref).abs().max() <= 0.02 * ref.abs().max()


def test_an_unknown_kernel_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HAFIZA_CPU_KERNEL", "fast")
    kernel_choice.cpu_kernel.cache_clear()
    try:
        with pytest.raises(ConfigError, match="HAFIZA_CPU_KERNEL='fast'"):
            kernel_choice.cpu_kernel()
    finally:
        kernel_choice.cpu_kernel.cache_clear()
