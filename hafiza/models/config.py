"""ModelConfig: the architecture facts the forward and the KV cache need, from config.json or GGUF metadata."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from hafiza.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass
class ModelConfig:
    """Llama-family hyper-parameters. `arch` is one of llama, mistral, qwen2 (qwen2 has q/k/v bias)."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict; raises ModelLoadError for other architectures."""
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            arch = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}.get(cfg.get("model_type", ""))
        if arch is None:
            found = ", ".join(archs) or cfg.get("model_type", "unknown")
            raise ModelLoadError(
                f"unsupported architecture {found!r}: hafiza runs Llama, Mistral and Qwen2 style models"
            )
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = [int(e) for e in eos] if isinstance(eos, list) else ([int(eos)] if eos is not None else [])
        return cls(
            arch=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", arch == "mistral") else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=str(cfg.get("_name_or_path", "")),
        )

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict transformers accepts, used to build the reference model in tests and benchmarks."""
        arch_name = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.arch]
        cfg: dict[str, Any] = {
            "architectures": [arch_name],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if self.eos_token_ids else None,
        }
        if self.arch == "llama":
            cfg["attention_bias"] = self.attention_bias
            cfg["mlp_bias"] = False
        if self.arch == "qwen2":
            cfg["use_sliding_window"] = False
        if self.arch == "mistral":
            cfg["sliding_window"] = self.sliding_window
        return cfg

    def fingerprint(self) -> str:
        """A stable hex digest of the architecture, part of every prefix-cache key."""
        blob = json.dumps(asdict(self), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
