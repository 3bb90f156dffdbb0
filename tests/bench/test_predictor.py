"""`hafiza bench predictor` on a tiny model: every spec's cost fraction and bits/value come from a real pass and a
bit-exact round trip through the store codec; a spec the target cannot take is skipped, not faked."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from hafiza.bench.predictor import measure
from hafiza.codec.predictors.cheap import CheapSpec


def test_measure_reports_cost_fraction_and_bits_per_value(tiny_dirs: dict[str, Path]) -> None:
    specs = [CheapSpec("int8", "fp32"), CheapSpec("same", "fp32"), CheapSpec("int8", "bf16", exact_layers=1)]
    got = measure("fp32", "fp32", specs, 64, 32, Console(quiet=True), tiny_dirs["llama"])
    assert got["tokens"] == 64 and got["prefill_s_first"] > 0 and got["prefill_tok_s"] > 0
    rows = {r["predictor"]: r for r in got["rows"]}
    assert set(rows) == {"zstd", "fast", "int8:fp32:exact0", "same:fp32:exact0"}  # bf16 + exact layers: refused
    same, int8 = rows["same:fp32:exact0"], rows["int8:fp32:exact0"]
    assert same["cost_fraction"] > 0 and int8["cost_fraction"] > 0
    # the target's own weights predict its K/V exactly: far fewer bits than an int8 copy or zstd
    assert same["bits_per_value"] < int8["bits_per_value"] < rows["zstd"]["bits_per_value"]
