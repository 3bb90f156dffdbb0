"""Chained prefix hashes: H(parent, token_ids, extra_keys), identical in every process and on every machine.

The hash is SHA-256 (truncated to 128 bits, hex) over a fixed seed, the parent's hash, the block's token ids as
little-endian int32 and the extra keys as canonical JSON. Nothing depends on PYTHONHASHSEED or the process —
the bug LMCache users hit when each process salted its hashes differently and no instance ever hit another's.

A cache partition (an API key's, a request's `cache_salt`, or both: see `partition`) is one of the extra keys, so
it enters the hash of the chain's root block and, through the chain and directly, every block after it: two
partitions never share a block hash, in the KV pool or as a store-tier key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import NewType

import numpy as np

BlockHash = NewType("BlockHash", str)  # a block's chained hash: the prefix cache's and the tiers' key

HASH_SEED = b"hafiza-prefix-hash-v1"
ROOT_PARENT = "0" * 32
PARTITION_SEED = b"hafiza-cache-partition-v1"
KEY_SEED = b"hafiza-api-key-partition-v1"


def key_partition(api_key: str) -> str:
    """The cache partition of an API key: a hash of it (the key itself never enters a cache key or a log)."""
    return hashlib.sha256(KEY_SEED + api_key.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def partition(*parts: str | None) -> str | None:
    """One partition from its parts in order (e.g. the key's partition, then the request's salt); None when every
    part is None (the shared partition). Parts are length-prefixed, so ("ab", "c") and ("a", "bc") differ."""
    if all(p is None for p in parts):
        return None
    h = hashlib.sha256(PARTITION_SEED)
    for p in parts:
        data = b"" if p is None else p.encode("utf-8", "surrogatepass")
        h.update(b"\x00" if p is None else b"\x01")
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:32]


def block_hash(parent: str | None, token_ids: Sequence[int], extra_keys: Sequence[object] = ()) -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block)."""
    h = hashlib.sha256(HASH_SEED)
    h.update((parent or ROOT_PARENT).encode())
    h.update(np.asarray(token_ids, dtype="<i4").tobytes())
    h.update(json.dumps(list(extra_keys), separators=(",", ":"), default=str).encode())
    return BlockHash(h.hexdigest()[:32])


def chain_hashes(
    token_ids: Sequence[int], block_size: int, extra_keys: Sequence[object] = (), start: int = 0,
    parent: str | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from block index `start` (whose parent hash is `parent`)."""
    out: list[BlockHash] = []
    for b in range(start, len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[b * block_size : (b + 1) * block_size], extra_keys)
        out.append(parent)
    return out
