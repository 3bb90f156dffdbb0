"""`hafiza serve --store-*` option checks and the `x-hafiza-tiers` header value."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hafiza.engine import RequestOutput
from hafiza.store.serving import StoreOptions, tiers_header


@pytest.mark.parametrize(("args", "message"), [
    (["--store-codec", "gzip"], "--store-codec 'gzip': choose one of raw, zstd, exponent, predictive"),
    (["--store-disk", "/tmp/x", "--store-write-back"], "--store-write-back needs --store-ram"),
    (["--store-ram", "lots"], "cannot read size 'lots'"),
    (["--store-redis", "http://h:1"], "scheme must be redis://"),
])  # fmt: skip
def test_bad_store_option_is_one_line_before_the_model_loads(args: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "hafiza", "serve", *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert message in proc.stderr


def test_no_store_option_means_no_store() -> None:
    assert not StoreOptions().enabled
    assert StoreOptions(redis="redis://127.0.0.1:1").enabled


def test_tiers_header_counts_tokens_by_source_in_ascii() -> None:
    out = RequestOutput("r", [1], "x", False, num_prompt_tokens=2030, num_cached_tokens=2016, external_tokens=2000,
                        external_sources={"ram": 800, "disk": 1200},
                        external_decision="load: 1.00 MB from disk at 1 MB/s ≈ 1.0 ms < recompute 2000 tokens ≈ 2.0 s")
    value = tiers_header(out)
    assert value.startswith("decision=load; pool=16; ram=800; disk=1200; computed=14; why=load: 1.00 MB")
    assert "~ 1.0 ms" in value and value.isascii()
    miss = RequestOutput("r", [], "", False, num_prompt_tokens=40, num_cached_tokens=16)
    assert tiers_header(miss) == "decision=none; pool=16; computed=24"
