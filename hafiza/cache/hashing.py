"""Chained prefix hashes: H(parent, token_ids, extra_keys), identical in every process and on every machine.

The hash is SHA-256 (truncated to 128 bits, hex) over a fixed seed, the parent's hash, the block's token ids as
little-endian int32 and the extra keys as canonical JSON. Nothing depends on PYTHONHASHSEED or the process —
the bug LMCache users hit when each process salted its hashes differently and no instance ever hit another's.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import numpy as np

HASH_SEED = b"hafiza-prefix-hash-v1"
ROOT_PARENT = "0" * 32


def block_hash(parent: str | None, token_ids: Sequence[int], extra_keys: Sequence[object] = ()) -> str:
    """Hash of one full block given its parent's hash (None for the first block)."""
    h = hashlib.sha256(HASH_SEED)
    h.update((parent or ROOT_PARENT).encode())
    h.update(np.asarray(token_ids, dtype="<i4").tobytes())
    h.update(json.dumps(list(extra_keys), separators=(",", ":"), default=str).encode())
    return h.hexdigest()[:32]


def chain_hashes(
    token_ids: Sequence[int], block_size: int, extra_keys: Sequence[object] = (), start: int = 0,
    parent: str | None = None,
) -> list[str]:
    """Hashes of the full blocks of `token_ids` from block index `start` (whose parent hash is `parent`)."""
    out: list[str] = []
    for b in range(start, len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[b * block_size : (b + 1) * block_size], extra_keys)
        out.append(parent)
    return out
