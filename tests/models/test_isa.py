"""The ISA-sensitive tests again under torch's AVX2 kernels, in a subprocess with ATEN_CPU_CAPABILITY=avx2: on an
AVX-512 machine the int4 layout (64-row blocks there, 32 under AVX2), the BLAS kernels and their rounding all
change, so one machine checks both."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ISA_SENSITIVE = [
    "tests/models/test_linear_formats.py",
    "tests/models/test_ggml_repack.py",
    "tests/models/test_linear_invariance.py",
    "tests/models/test_cpu_linear.py",
    "tests/models/test_attention_invariance.py",
    "tests/models/test_weight_cache.py",
    "tests/engine/test_cache_invariance.py",
]


def test_capability_switch_reaches_torch() -> None:
    """The variable this file relies on does switch torch's kernels (else the rerun below would test nothing)."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                         env={**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "AVX2"


@pytest.mark.timeout(1800)
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                    reason="this CPU runs torch's AVX2 kernels already: the main run covers them")
def test_isa_sensitive_tests_pass_under_avx2() -> None:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ISA_SENSITIVE]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, f"under ATEN_CPU_CAPABILITY=avx2:\n{out.stdout[-6000:]}\n{out.stderr[-2000:]}"
