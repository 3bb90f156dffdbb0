"""The one size parser: binary Ki/Mi/Gi/Ti, decimal K/M/G/T, bare numbers are bytes; errors quote the text."""

from __future__ import annotations

import pytest

from hafiza.errors import ConfigError, HafizaError
from hafiza.sizes import parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("1048576", 1 << 20),
        ("100B", 100),
        ("512M", 512 * 10**6),
        ("512m", 512 * 10**6),
        ("512MB", 512 * 10**6),
        ("512Mi", 512 << 20),
        ("512MiB", 512 << 20),
        ("512mib", 512 << 20),
        ("2GiB", 2 << 30),
        ("2Gi", 2 << 30),
        ("2G", 2 * 10**9),
        ("1.5G", 1_500_000_000),
        ("1.5GiB", 3 << 29),
        ("64KiB", 64 << 10),
        ("64K", 64_000),
        ("100MB", 100_000_000),
        ("1TB", 10**12),
        ("1Ti", 1 << 40),
        (" 8 Ki ", 8192),
        ("0.5KiB", 512),
        (4096, 4096),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "-1", "2 XB", "1e9", "G", "5GiBs", "2iB", -5, 1.5, True])
def test_parse_size_rejects_garbage_naming_it(text: object) -> None:
    with pytest.raises(ConfigError) as e:
        parse_size(text)  # type: ignore[arg-type]
    assert isinstance(e.value, HafizaError)
    assert repr(text) in str(e.value) or str(text) in str(e.value)


def test_kv_memory_and_store_sizes_agree() -> None:
    """The KV pool size and the store tier sizes read "512M" the same way."""
    import torch

    from hafiza.cache.memory import kv_memory_bytes
    from hafiza.store.config import parse_disk_spec

    cpu = torch.device("cpu")
    assert kv_memory_bytes("512M", cpu) == parse_size("512M") == parse_disk_spec("/kv:512M").capacity_bytes
    assert kv_memory_bytes("512MiB", cpu) == parse_disk_spec("/kv:512MiB").capacity_bytes == 512 << 20
