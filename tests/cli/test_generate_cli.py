"""`hafiza generate` and `hafiza memory` as a user runs them: output, and one clear line on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hafiza.models.loader import default_model_path


def hafiza(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hafiza", *args], capture_output=True, text=True, timeout=timeout)


def assert_clean_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_generate_names_paris() -> None:
    proc = hafiza("generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "TTFT" in proc.stderr and "tok/s" in proc.stderr


def test_missing_model_file(tmp_path: Path) -> None:
    assert_clean_error(hafiza("generate", "x", "--model", str(tmp_path / "nope.gguf")), "model not found")


def test_truncated_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(default_model_path().read_bytes()[: 3_000_000])
    assert_clean_error(hafiza("generate", "x", "--model", str(bad)), "truncated.gguf")


def test_corrupt_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    assert_clean_error(hafiza("generate", "x", "--model", str(bad)), "corrupt.gguf")


def test_not_a_model(tmp_path: Path) -> None:
    bad = tmp_path / "notes.txt"
    bad.write_text("hello")
    assert_clean_error(hafiza("generate", "x", "--model", str(bad)), "not a GGUF file")


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    assert_clean_error(hafiza("generate", "x", "--model", str(tmp_path)), "unsupported architecture", "GPT2LMHeadModel")


def test_eviction_without_budget_names_the_flag() -> None:
    assert_clean_error(hafiza("generate", "hi", "--eviction", "streaming"), "--kv-budget-tokens:", "token budget")


def test_too_small_budget_is_one_line_naming_the_flag() -> None:
    assert_clean_error(hafiza("generate", "hi", "--eviction", "streaming", "--kv-budget-tokens", "16"),
                       "--kv-budget-tokens:", "is too small", "at least")


def test_context_over_model_limit() -> None:
    assert_clean_error(hafiza("generate", "hello", "--max-tokens", "9000"), "exceeds the model's context of 8192")


@pytest.mark.parametrize(("ctx", "expect"), [(8192, 188_743_680), (131072, 3_019_898_880)])
def test_memory_default_model(ctx: int, expect: int) -> None:
    proc = hafiza("memory", "--context", str(ctx))
    assert proc.returncode == 0, proc.stderr
    assert f"total_bytes={expect}" in proc.stdout  # 30 layers x 3 KV heads x 64 x 2 (K,V) x 2 bytes = 23,040 B/token


def test_memory_llama3_70b_without_weights() -> None:
    proc = hafiza("memory", "--context", "131072", "--layers", "80", "--kv-heads", "8", "--heads", "64",
                  "--head-dim", "128")
    assert proc.returncode == 0, proc.stderr
    assert "bytes_per_token=327680" in proc.stdout and "MHA (64 KV heads)" in proc.stdout


def test_memory_counts_scales_as_the_pool_stores_them() -> None:
    proc = hafiza("memory", "--context", "16", "--dtype", "int8")
    assert proc.returncode == 0, proc.stderr
    assert "bytes_per_token=11880" in proc.stdout  # 30 layers x 3 KV heads x 2 (K,V) x (64 codes + 2 B scale)
    assert_clean_error(hafiza("memory", "--context", "16", "--dtype", "int3"), "unknown KV dtype 'int3'")
