"""Store keys for KV blocks: the chained prefix hash qualified by everything that changes the stored bytes."""

from __future__ import annotations

import re

KEY_VERSION = "hz1"
_TOKEN = re.compile(r"[A-Za-z0-9._+-]{1,128}")
_HEX = re.compile(r"[0-9a-f]{8,128}")


def _check(name: str, value: str, pattern: re.Pattern[str]) -> str:
    """Reject a key component that could collide with the separator or break a file name."""
    if not pattern.fullmatch(value):
        raise ValueError(f"block_key: {name}={value!r} must match {pattern.pattern}")
    return value


def block_key(prefix_hash_hex: str, model_fingerprint: str, kv_dtype: str, block_size: int, codec_id: str) -> str:
    """`hz1:<model>:<dtype>:<block_size>:<codec>:<hash>`: different models/dtypes/codecs never collide."""
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_key: block_size={block_size!r} must be a positive int")
    return ":".join(
        (
            KEY_VERSION,
            _check("model_fingerprint", model_fingerprint, _TOKEN),
            _check("kv_dtype", kv_dtype, _TOKEN),
            str(block_size),
            _check("codec_id", codec_id, _TOKEN),
            _check("prefix_hash_hex", prefix_hash_hex.lower(), _HEX),
        )
    )
