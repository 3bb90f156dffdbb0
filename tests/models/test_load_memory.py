"""Loading a ~3B-parameter 4-bit GGUF never holds more than 1.3x the file in memory (peak RSS of the process,
torch itself included): tensors are repacked one at a time, never dequantized as a whole."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T

from hafiza.models.loader import default_model_path
from tests.support.gguf_models import Shape, write_model

SHAPE_3B = Shape(hidden=3072, inter=8192, layers=28, heads=24, kv_heads=8)  # Llama-3.2-3B's sizes, 49k vocab

LOAD = """
import sys
from hafiza.models import load_model
lm = load_model(sys.argv[1], device="cpu")
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(hwm, sorted(lm.model.weights.formats()))
"""


@pytest.fixture(scope="module")
def model_3b(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("big") / "synthetic-3b.Q4_1.gguf"
    write_model(path, default_model_path(), {"default": T.Q4_1}, SHAPE_3B, reuse=True)
    yield path
    path.unlink()


def test_peak_rss_of_loading_3b_q4_1(model_3b: Path) -> None:
    size = model_3b.stat().st_size
    assert size > 1.8e9  # ~2.97e9 parameters at 20 bytes per 32
    env = {**os.environ, "HAFIZA_WEIGHTS_CACHE": "off"}  # the bound is on repacking, not on mapping a cached copy
    out = subprocess.run([sys.executable, "-c", LOAD, str(model_3b)], capture_output=True, text=True, timeout=600,
                         check=True, env=env).stdout.split(maxsplit=1)
    peak = int(out[0])
    assert "int4" in out[1] and "gguf-Q4_1" in out[1]
    assert peak <= 1.3 * size, f"peak RSS {peak / 2**30:.2f} GiB for a {size / 2**30:.2f} GiB file ({peak / size:.2f}x)"
