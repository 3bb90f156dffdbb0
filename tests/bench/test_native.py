"""The native-store bench on a tiny model: one row per (KV dtype, codec), native blocks smaller than their
dequantised form, full precision unchanged."""

from __future__ import annotations

from pathlib import Path

from hafiza.bench.native import measure


def test_native_rows_against_dequantised(tiny_dirs: dict[str, Path]) -> None:
    data = measure(str(tiny_dirs["llama"]), "fp32", 48, ["bf16", "int8", "int4"], ["raw", "zstd", "speculative"])
    rows = {(r["kv_dtype"], r["codec"]): r for r in data["results"]}
    assert set(rows) == {(k, c) for k in ("bf16", "int8", "int4") for c in ("raw", "zstd")} | {
        ("bf16", "speculative"), ("int8", "speculative")}  # int4 has no predicted codes
    assert all(r["blocks"] == 3 for r in rows.values())
    assert rows["bf16", "raw"]["ratio"] == 1.0
    for kind in ("int8", "int4"):  # fp32 compute: dequantised raw is 4 bytes a value
        raw = rows[kind, "raw"]
        assert raw["ratio"] > 2.0
        assert raw["pool_bytes_per_block"] / 1024 <= raw["native_kb_per_block"]
