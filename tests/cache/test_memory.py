"""KV memory sizing: the one bytes-per-token formula and reading a KV memory setting."""

from __future__ import annotations

import pytest
import torch

from hafiza.cache.layout import KVLayout
from hafiza.cache.memory import free_device_memory, kv_bytes_per_token, kv_memory_bytes
from hafiza.cache.pool import bytes_per_block, bytes_per_token, make_kv_pool
from hafiza.errors import ConfigError


def test_kv_bytes_per_token_counts_k_and_v_over_all_layers() -> None:
    # SmolLM2-135M: 30 layers, 3 KV heads of 64 dims; bf16 is 2 bytes per element.
    assert kv_bytes_per_token(30, 3, 64 * 2) == 2 * 30 * 3 * 64 * 2 == 23_040
    assert kv_bytes_per_token(1, 1, 0.5) == 1.0


@pytest.mark.parametrize(("kv_dtype", "bits"), [("fp32", 32), ("bf16", 16), ("fp16", 16)])
def test_full_precision_pool_uses_the_same_formula(kv_dtype: str, bits: int) -> None:
    layout = KVLayout(num_layers=30, num_blocks=4, block_size=16, num_kv_heads=3, head_dim=64, kv_dtype=kv_dtype,
                      compute_dtype=torch.float32)
    assert bytes_per_token(layout) == kv_bytes_per_token(30, 3, 64 * bits / 8) == 2 * 30 * 3 * 64 * bits // 8
    assert bytes_per_block(layout) == 16 * bytes_per_token(layout)
    assert make_kv_pool(layout, "cpu").bytes_per_block == bytes_per_block(layout)


def test_kv_memory_reads_sizes_fractions_and_auto() -> None:
    cpu = torch.device("cpu")
    assert kv_memory_bytes("512MiB", cpu) == 512 << 20
    assert kv_memory_bytes("512M", cpu) == 512 * 10**6
    assert kv_memory_bytes(4096, cpu) == 4096
    assert 0 < kv_memory_bytes("0.5", cpu) <= free_device_memory(cpu)
    assert 0 < kv_memory_bytes("auto", cpu) <= 2**30


@pytest.mark.parametrize("spec", ["lots", "2XB", 1.5, 0.0])
def test_kv_memory_rejects_bad_settings_without_naming_a_flag(spec: str | float) -> None:
    with pytest.raises(ConfigError) as e:
        kv_memory_bytes(spec, torch.device("cpu"))
    assert "--" not in str(e.value) and str(spec) in str(e.value) and e.value.setting == "kv_memory"
