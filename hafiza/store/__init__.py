"""Storage tiers below the working KV pool: host RAM, local disk and Redis/Valkey, behind one interface."""

from hafiza.store.base import KVStore
from hafiza.store.config import build_tiers, parse_disk_spec, parse_redis_url, parse_size
from hafiza.store.cost import CostModel, LoadDecision
from hafiza.store.disk import DiskStore
from hafiza.store.keys import block_key
from hafiza.store.memory import MemoryStore
from hafiza.store.redis_store import RedisStore
from hafiza.store.stats import LatencyHistogram, StoreStats
from hafiza.store.tiered import PrefixLookup, TieredStore

__all__ = [
    "CostModel",
    "DiskStore",
    "KVStore",
    "LatencyHistogram",
    "LoadDecision",
    "MemoryStore",
    "PrefixLookup",
    "RedisStore",
    "StoreStats",
    "TieredStore",
    "block_key",
    "build_tiers",
    "parse_disk_spec",
    "parse_redis_url",
    "parse_size",
]
