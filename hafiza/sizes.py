"""One parser for byte sizes given by the user (KV pool, store tiers): binary Ki/Mi/Gi/Ti, decimal K/M/G/T.

"KiB", "MiB", "GiB", "TiB" (or "Ki", "Mi", "Gi", "Ti") are powers of 1024; "K", "M", "G", "T" (or "KB", "MB",
"GB", "TB") are powers of 1000; a bare number or "B" is bytes. Units are case-insensitive, fractions round down.
"""

from __future__ import annotations

import re

from hafiza.errors import ConfigError

SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(i?b|i)?|(b))?\s*", re.IGNORECASE)
_POWER = {"k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str | int) -> int:
    """Bytes from "2GiB", "512Mi", "1.5G", "100MB" or a plain count; see the module docstring."""
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise ConfigError(f"size {text!r} must be a number of bytes or a string such as 512MiB, 2GB")
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"size {text} must be >= 0")
        return text
    m = SIZE_RE.fullmatch(text)
    if not m:
        raise ConfigError(f"cannot read size {text!r}: use bytes or a unit such as 512MiB, 2Gi, 100MB")
    number, unit, suffix = float(m.group(1)), m.group(2), m.group(3)
    if unit is None:
        return int(number)
    base = 1024 if suffix is not None and suffix.lower().startswith("i") else 1000
    return int(number * base ** _POWER[unit.lower()])
