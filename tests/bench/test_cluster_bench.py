"""`hafiza bench cluster` run tiny for real (vllm-router, 2 hafiza instances, redis-server, and one instance
alone): every policy's entry has its fields, the routed greedy answers equal the single instance's, and the JSON
and the markdown region are written. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hafiza.bench.cluster import POLICIES, SINGLE, tiers_split
from hafiza.bench.commands import bench_app
from tests.support.redis_server import redis_available

FIELDS = {"policy", "requests", "hit_rate", "pool_hit_rate", "redis_hit_rate", "mean_ttft_s", "p99_ttft_s", "tok_s",
          "requests_per_worker", "identical"}


def test_the_tiers_header_splits_into_pool_and_redis_tokens() -> None:
    assert tiers_split("decision=load; pool=32; redis=64; computed=7; why=load: x") == (32, 64)
    assert tiers_split("decision=none; pool=16; computed=3") == (16, 0)
    assert tiers_split("") == (0, 0)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not redis_available(), reason="redis-server is not installed")
def test_a_tiny_cluster_bench_reports_every_policy_with_identical_answers(tmp_path: Path) -> None:
    out, doc = tmp_path / "cluster.json", tmp_path / "BENCH.md"
    result = CliRunner().invoke(bench_app, [
        "cluster", "--prompts", "2", "--users", "2", "--turns", "2", "--system-words", "40", "--max-tokens", "3",
        "--kv-memory", "64MiB", "--json", str(out), "--doc", str(doc)])
    assert result.exit_code == 0, result.output
    res = json.loads(out.read_text())
    assert [r["policy"] for r in res["results"]] == [SINGLE, *POLICIES]
    for r in res["results"]:
        assert r.keys() >= FIELDS, r
        assert r["requests"] == 8 and sum(r["requests_per_worker"]) == 8, r
        assert len(r["requests_per_worker"]) == (1 if r["policy"] == SINGLE else 2)
        assert r["identical"] is True, r["policy"]
        assert 0 <= r["pool_hit_rate"] + r["redis_hit_rate"] <= r["hit_rate"] + 1e-9 <= 1 + 1e-9
    assert {"kv_over_rr_hit", "kv_over_single_hit", "kv_ttft_met"} <= res["targets"].keys()
    assert "<!-- bench:cluster:start -->" in doc.read_text() and "kv_aware" in doc.read_text()
