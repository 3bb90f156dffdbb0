"""Lossy KV formats (fp8, int8, int4 KIVI-style) as drop-in paged pools, and token eviction policies."""

from hafiza.quant.errors import NonFiniteKVError
from hafiza.quant.factory import KV_KINDS, bytes_per_token, make_kv_cache, tokens_that_fit

__all__ = ["KV_KINDS", "NonFiniteKVError", "bytes_per_token", "make_kv_cache", "tokens_that_fit"]
