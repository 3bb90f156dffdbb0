"""Rerunning tests under torch's AVX2 kernels on an AVX-512 machine, so one machine checks both ISAs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

needs_avx512 = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                                  reason="this CPU runs torch's AVX2 kernels already: the main run covers them")


def rerun_under_avx2(files: list[str]) -> None:
    """Run `files` with pytest in a subprocess with ATEN_CPU_CAPABILITY=avx2; fail with the tail of its output."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *files]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, f"under ATEN_CPU_CAPABILITY=avx2:\n{out.stdout[-6000:]}\n{out.stderr[-2000:]}"
