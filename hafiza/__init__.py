"""hafiza: an LLM inference engine built around its KV cache.

Importing hafiza changes nothing in the process: the entry points set what must be set before torch loads
(`hafiza.threads.openmp_defaults`, called by `hafiza.cli.main`).
"""

__version__ = "0.1.0"
