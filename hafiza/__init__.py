"""hafiza: an LLM inference engine built around its KV cache."""

__version__ = "0.1.0"
