"""The fast coder's decode profile: every stage is timed over the chunks the container really has."""

from __future__ import annotations

import pytest
import torch

from hafiza.bench.codec.profile import profile


def test_profile_times_each_stage_of_every_chunk() -> None:
    x = (torch.randn(2, 600, 2, 16) * 0.3).bfloat16()  # 2 layers x 3 chunks (256, 256, 88 tokens)
    r = profile(x)
    assert r["chunks"] == 6
    assert r["bytes_per_chunk"] == x.numel() * 2 / 6
    assert r["decode_us"] > 0 and r["zstd_us"] > 0 and r["crc_us"] > 0
    assert r["decode_MBps"] == pytest.approx(x.numel() * 2 / (r["decode_us"] * 6))
