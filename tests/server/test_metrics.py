"""GET /metrics: vLLM-like names under hafiza:, and the cache-savings counters move with cached requests."""

from __future__ import annotations

import re
import time

import httpx

from tests.server.conftest import Server

NAMES = ["kv_cache_usage_perc", "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
         "num_requests_running", "num_requests_waiting", "prompt_tokens_total", "generation_tokens_total",
         "request_success_total", "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
         "e2e_request_latency_seconds_bucket", "cache_read_tokens_total", "cache_write_tokens_total",
         "cache_cost_saved", "prompt_cost_total", "request_errors_total"]


def value(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"hafiza:{name}(\{{[^}}]*\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def test_metric_names(http: httpx.Client, server: Server) -> None:
    http.post("/v1/messages", json={"model": server.model, "max_tokens": 2,
                                    "messages": [{"role": "user", "content": "metrics please"}]})
    http.post("/v1/messages", json={"model": "nope", "max_tokens": 2, "messages": []})
    text = http.get("/metrics").text
    for name in NAMES:
        assert f"hafiza:{name}" in text, name
    for state in ("free", "cached", "in_use", "pinned"):
        assert re.search(rf'hafiza:kv_blocks\{{[^}}]*state="{state}"\}}', text), state
    assert value(text, "request_errors_total", api="anthropic", status="400") >= 1


def test_cache_savings_follow_usage(http: httpx.Client, server: Server, warm_document: str) -> None:
    before = http.get("/metrics").text
    r = http.post("/v1/messages", json={
        "model": server.model, "max_tokens": 1, "messages": [{"role": "user", "content": "savings"}],
        "system": [{"type": "text", "text": warm_document, "cache_control": {"type": "ephemeral"}}]})
    read = r.json()["usage"]["cache_read_input_tokens"]
    assert read >= 1024
    after = http.get("/metrics").text
    grew = value(after, "cache_read_tokens_total", api="anthropic") - value(before, "cache_read_tokens_total",
                                                                           api="anthropic")
    assert grew == read
    saved = value(after, "cache_cost_saved", api="anthropic") - value(before, "cache_cost_saved", api="anthropic")
    assert abs(saved - read * 0.9 * 3.0 / 1e6) < 1e-9
    assert hits_grow_past(http, value(before, "prefix_cache_hits_total"))


def hits_grow_past(http: httpx.Client, before: float, timeout_s: float = 30.0) -> bool:
    """Whether `prefix_cache_hits_total` rises above `before` within `timeout_s` (polled: the engine counters on
    /metrics come from the engine thread's snapshot, which a busy machine can take a moment to publish)."""
    deadline = time.monotonic() + timeout_s
    while value(http.get("/metrics").text, "prefix_cache_hits_total") <= before:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_metrics_agree_with_every_response_already_sent(http: httpx.Client, server: Server) -> None:
    """Engine counters on /metrics are taken before a request's last output is delivered: read right after a
    response, they already count it (no waiting, no race with the periodic snapshot)."""
    for i in range(6):
        before = http.get("/metrics").text
        r = http.post("/v1/chat/completions", json={"model": server.model, "max_tokens": 1 + i % 3, "messages": [
            {"role": "user", "content": f"consistent metrics {i}"}]})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        after = http.get("/metrics").text
        assert value(after, "prompt_tokens_total") - value(before, "prompt_tokens_total") == usage["prompt_tokens"]
        assert (value(after, "generation_tokens_total") - value(before, "generation_tokens_total")
                == usage["completion_tokens"])
        assert (value(after, "prefix_cache_queries_total") - value(before, "prefix_cache_queries_total")
                >= usage["prompt_tokens"] - 1)
