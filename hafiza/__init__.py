"""hafiza: an LLM inference engine built around its KV cache."""

from hafiza.threads import openmp_defaults

openmp_defaults()  # before anything imports torch: OpenMP reads its wait policy once, when it loads

__version__ = "0.1.0"
