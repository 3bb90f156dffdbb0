"""Prefix hashes are chained, sensitive to every input, and identical across processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from hafiza.cache.hashing import block_hash, chain_hashes

TOKENS = list(range(1000, 1100))
EXTRA = ("model-fp", "bf16", 16, None)


def test_chain_depends_on_parent_tokens_and_extra_keys() -> None:
    hashes = chain_hashes(TOKENS, 16, EXTRA)
    assert len(hashes) == 6 and len(set(hashes)) == 6
    assert hashes[1] == block_hash(hashes[0], TOKENS[16:32], EXTRA)
    assert chain_hashes(TOKENS, 16, ("other-model", "bf16", 16, None))[0] != hashes[0]
    assert chain_hashes(TOKENS, 16, (*EXTRA[:3], "salt"))[0] != hashes[0]
    changed = [*TOKENS[:20], 7, *TOKENS[21:]]
    assert chain_hashes(changed, 16, EXTRA)[:1] == hashes[:1]
    assert chain_hashes(changed, 16, EXTRA)[1:] != hashes[1:]


def test_incremental_extension_equals_full_chain() -> None:
    first = chain_hashes(TOKENS[:48], 16, EXTRA)
    rest = chain_hashes(TOKENS, 16, EXTRA, start=3, parent=first[-1])
    assert first + rest == chain_hashes(TOKENS, 16, EXTRA)


def test_same_hashes_in_another_process_with_another_hash_seed() -> None:
    code = (
        "import json; from hafiza.cache.hashing import chain_hashes; "
        f"print(json.dumps(chain_hashes({TOKENS!r}, 16, {list(EXTRA)!r})))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert json.loads(out.stdout) == chain_hashes(TOKENS, 16, list(EXTRA))


def test_partitions_are_distinct_and_never_contain_the_key() -> None:
    from hafiza.cache.hashing import key_partition, partition

    assert partition() is None and partition(None, None) is None
    key = key_partition("sk-secret-1")
    assert "sk-secret-1" not in key and key != key_partition("sk-secret-2")
    parts = {partition(key, None), partition(None, "s"), partition(key, "s"), partition("ab", "c"),
             partition("a", "bc"), partition("\ud800")}
    assert len(parts) == 6
    assert partition(key, "s") == partition(key, "s")
    first = {chain_hashes(TOKENS, 16, (*EXTRA[:3], p))[0] for p in (None, *parts)}
    assert len(first) == 7
