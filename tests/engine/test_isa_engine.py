"""The engine's cache-invariance tests again under torch's AVX2 kernels (a subprocess with ATEN_CPU_CAPABILITY=avx2),
in a file of its own so that a parallel run gives it a worker of its own."""

from __future__ import annotations

import pytest

from tests.support.isa import needs_avx512, rerun_under_avx2

pytestmark = pytest.mark.slow


@pytest.mark.timeout(1800)
@needs_avx512
def test_cache_invariance_passes_under_avx2() -> None:
    rerun_under_avx2(["tests/engine/test_cache_invariance.py"])
