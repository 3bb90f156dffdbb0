"""The ISA-sensitive model tests again under torch's AVX2 kernels, in a subprocess with ATEN_CPU_CAPABILITY=avx2: on
an AVX-512 machine the int4 layout (64-row blocks there, 32 under AVX2), the BLAS kernels and their rounding all
change, so one machine checks both (the engine's cache-invariance rerun: tests/engine/test_isa_engine.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.isa import needs_avx512, rerun_under_avx2

ISA_SENSITIVE = [
    "tests/models/test_linear_formats.py",
    "tests/models/test_ggml_repack.py",
    "tests/models/test_linear_invariance.py",
    "tests/models/test_cpu_linear.py",
    "tests/models/test_attention_invariance.py",
    "tests/models/test_weight_cache.py",
]
pytestmark = pytest.mark.slow


def test_capability_switch_reaches_torch() -> None:
    """The variable this file relies on does switch torch's kernels (else the rerun below would test nothing)."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                         env={**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "AVX2"


@pytest.mark.timeout(1800)
@needs_avx512
def test_isa_sensitive_tests_pass_under_avx2() -> None:
    rerun_under_avx2(ISA_SENSITIVE)
