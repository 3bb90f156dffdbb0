"""The capacity bench's pure parts: Zipf workloads, metrics parsing, residency counting and the results rows."""

from __future__ import annotations

from collections import Counter

import pytest

from hafiza.bench.capacity import (
    CodecRun,
    Request,
    Sample,
    metric_values,
    parse_tiers,
    percentile,
    prefixes_resident,
    summarize,
    tier_tokens,
    workload,
    zipf_weights,
)


def test_zipf_weights_fall_as_one_over_rank() -> None:
    w = zipf_weights(4, 1.0)
    assert sum(w) == pytest.approx(1.0)
    assert w[0] / w[1] == pytest.approx(2.0)
    assert w[0] / w[3] == pytest.approx(4.0)
    assert zipf_weights(3, 0.0) == pytest.approx([1 / 3] * 3)


def test_workload_is_seeded_and_zipf_favours_the_first_prefix() -> None:
    zipf = workload(10, 2000, 6, "zipf", 1.0, seed=3)
    assert zipf == workload(10, 2000, 6, "zipf", 1.0, seed=3)
    counts = Counter(r.prefix for r in zipf)
    assert counts[0] > 3 * counts[9]  # expected ratio 10
    uniform = Counter(r.prefix for r in workload(10, 2000, 6, "uniform", 1.0, seed=3))
    assert max(uniform.values()) < 2 * min(uniform.values())
    assert {r.question for r in zipf} == set(range(6))
    with pytest.raises(ValueError, match="popularity"):
        workload(10, 5, 6, "pareto", 1.0, seed=0)


def test_percentile_interpolates() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx(2.5)
    assert percentile(list(range(101)), 0.99) == pytest.approx(99.0)


def test_prefixes_resident_needs_every_block() -> None:
    keys = {"a", "b", "c"}
    assert prefixes_resident(keys, [["a", "b"], ["a", "d"], ["c"], []]) == 2


def test_tiers_header_and_metrics_parsing() -> None:
    t = parse_tiers("decision=load; pool=16; redis=240; computed=20; why=load: 1 MB; from redis")
    assert t == {"decision": "load", "pool": "16", "redis": "240", "computed": "20"}
    page = "\n".join([
        "# TYPE hafiza:store_read_bytes counter",
        'hafiza:store_read_bytes_total{tier="ram",kind="memory"} 5.0',
        'hafiza:store_read_bytes_total{tier="redis",kind="redis"} 700.0',
        "# TYPE hafiza:store_predictor_seconds counter",
        "hafiza:store_predictor_seconds_total 1.5",
        "# TYPE hafiza:store_decisions counter",
        'hafiza:store_decisions_total{decision="load"} 3.0',
        'hafiza:store_decisions_total{decision="miss"} 2.0',
        "",
    ])
    assert metric_values(page) == {"read_bytes": 700.0, "predictor_seconds": 1.5, "decision_load": 3.0,
                                   "decision_miss": 2.0}


def test_summary_rows() -> None:
    a, b = Request(0, 0), Request(1, 2)
    run = CodecRun("zstd", samples=[Sample(a, 1.0, "yes", 0, 240, 20, "load", "load: 1 MB from redis"),
                                    Sample(b, 3.0, "no", 16, 0, 260, "miss")],
                   held=[1, 2, 3], metrics={"read_bytes": 600.0, "written_bytes": 200.0, "puts": 4.0,
                                            "decision_load": 1.0, "decision_predict": 0.0})
    row = summarize(run, {a: "yes", b: "no"}, tier_bytes=100, working_set_bytes=500)
    assert row["hit_rate"] == pytest.approx(240 / 520)
    assert row["request_hit_rate"] == 0.5
    assert row["mean_ttft_s"] == 2.0
    assert row["p99_ttft_s"] == pytest.approx(2.98)
    assert row["bytes_per_request"] == 400.0
    assert row["stored_bytes_per_block"] == 50.0
    assert row["prefixes_held"] == 2.0
    assert row["decisions"] == {"load": 1.0}
    assert row["identical"] is True
    assert [x["why"] for x in row["samples"]] == ["load: 1 MB from redis", ""]
    assert row["samples"][0]["redis_tokens"] == 240 and row["samples"][1]["decision"] == "miss"
    for key in ("codec", "tier_bytes", "working_set_bytes", "predictor_cpu_s"):
        assert key in row
    wrong = summarize(run, {a: "yes", b: "different"}, tier_bytes=100, working_set_bytes=500)
    assert wrong["identical"] is False and wrong["mismatched_requests"] == [1]


def test_rows_say_which_popularity_and_fallback_tokens_count_as_redis_hits() -> None:
    run = CodecRun("speculative", "uniform", samples=[Sample(Request(0, 0), 1.0, "x", 0, 240, 20, "load")])
    assert summarize(run, {Request(0, 0): "x"}, tier_bytes=1, working_set_bytes=5)["popularity"] == "uniform"
    assert tier_tokens(parse_tiers("decision=load; pool=0; redis=32; redis.fast=208; computed=20"), "redis") == 240
