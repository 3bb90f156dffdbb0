"""Storage formats of the KV pool (full precision, fp8, int8, int4), each behind the one KVPool interface."""
