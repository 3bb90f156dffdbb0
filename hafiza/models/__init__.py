"""Model loading (GGUF, Hugging Face directories), tokenizer and chat template, and the Llama-family forward."""

from hafiza.models.config import ModelConfig
from hafiza.models.loader import LoadedModel, default_model_path, load_model

__all__ = ["LoadedModel", "ModelConfig", "default_model_path", "load_model"]
