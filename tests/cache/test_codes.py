"""Quantise -> dequantise error bounds of each kernel, on ordinary and adversarial inputs."""

from __future__ import annotations

import torch

from hafiza.cache import codes


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


def test_int8_error_is_half_a_step_per_token_head() -> None:
    x = _x(50, 4, 64)
    q, s = codes.int8_quantize(x)
    err = (codes.int8_dequantize(q, s, torch.float32) - x).abs()
    amax = x.abs().amax(-1, keepdim=True)
    assert q.dtype == torch.int8 and s.dtype == torch.float16
    assert bool((err <= s.float().unsqueeze(-1) / 2 + amax * 2**-11 + 1e-6).all())


def test_int8_zeros_exact_constants_within_scale_rounding() -> None:
    x = torch.zeros(3, 2, 8)
    x[1] = 5.0
    q, s = codes.int8_quantize(x)
    y = codes.int8_dequantize(q, s, torch.float32)
    assert torch.equal(y[0], x[0]) and torch.equal(y[2], x[2])
    assert bool(((y[1] - 5.0).abs() <= 5.0 * 2**-11).all())


def test_fp8_relative_error_and_no_clipping() -> None:
    x = _x(32, 4, 64)
    s = codes.pow2_scale(x.abs().amax(), headroom=2.0)
    y = codes.fp8_decode(codes.fp8_encode(x, s), s, torch.float32)
    assert bool((y - x).abs().le(x.abs() * 2**-4 + s * 2**-9).all())
    assert float(torch.log2(s)) == round(float(torch.log2(s)))


def test_fp8_encode_saturates_instead_of_nan() -> None:
    s = torch.tensor(1.0)
    y = codes.fp8_decode(codes.fp8_encode(torch.tensor([1e6, -1e6]), s), s, torch.float32)
    assert y.tolist() == [448.0, -448.0]


def test_nibble_packing_round_trips() -> None:
    q = torch.randint(0, 16, (5, 3, 64), dtype=torch.uint8)
    assert torch.equal(codes.unpack_nibbles(codes.pack_nibbles(q)), q)


def test_int4_keys_per_channel_bound_with_an_outlier_channel() -> None:
    k = _x(2, 16, 2, 64)
    k[..., 7] *= 100.0
    rows = torch.ones(2, 16, dtype=torch.bool)
    packed, s, z = codes.int4_keys_quantize(k, rows)
    y = codes.int4_keys_dequantize(packed, s, z, torch.float32)
    span = k.amax(1) - k.amin(1)
    bound = span / 15 / 2 + span * 2**-10 + k.abs().amax(1) * 2**-10
    assert bool((y - k).abs().le(bound.unsqueeze(1)).all())
    others = torch.cat([(y - k)[..., :7], (y - k)[..., 8:]], -1).abs().max()
    assert float(others) < 0.5 * float((y - k)[..., 7].abs().max())


def test_int4_constant_and_zero_channels_are_exact() -> None:
    k = _x(1, 16, 2, 64)
    k[..., 3] = 0.0
    k[..., 5] = 1.25
    packed, s, z = codes.int4_keys_quantize(k, torch.ones(1, 16, dtype=torch.bool))
    y = codes.int4_keys_dequantize(packed, s, z, torch.float32)
    assert torch.equal(y[..., 3], k[..., 3]) and torch.equal(y[..., 5], k[..., 5])


def test_int4_keys_ignore_unwritten_rows() -> None:
    k = _x(1, 16, 1, 8)
    k[0, 10:] = 1000.0
    rows = torch.zeros(1, 16, dtype=torch.bool)
    rows[0, :10] = True
    packed, s, z = codes.int4_keys_quantize(k, rows)
    y = codes.int4_keys_dequantize(packed, s, z, torch.float32)
    span = (k[0, :10].amax(0) - k[0, :10].amin(0))
    assert bool(((y - k)[0, :10].abs() <= span / 30 + 1e-2).all())


def test_int4_values_per_token_group_bound() -> None:
    v = _x(16, 2, 64)
    v[3] *= 50.0
    packed, s, z = codes.int4_values_quantize(v, 32)
    y = codes.int4_values_dequantize(packed, s, z, 32, torch.float32)
    g = v.unflatten(-1, (2, 32))
    span = (g.amax(-1) - g.amin(-1)).repeat_interleave(32, -1)
    assert bool(((y - v).abs() <= span / 30 + span * 2**-10 + v.abs() * 2**-10 + 1e-6).all())
    assert float((y - v)[4].abs().max()) < float((y - v)[3].abs().max()) / 10
