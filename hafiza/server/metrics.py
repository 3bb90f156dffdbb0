"""Prometheus metrics under `hafiza:` (vLLM-like names): engine state read live, request metrics counted here.

The registry is per app (`ServerMetrics.registry`), so other parts (dashboard, tiered store) can register their
own collectors on it and they appear on GET /metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from hafiza.engine.results import EngineStats
from hafiza.server.settings import PriceTable
from hafiza.server.usage import CacheUsage

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
                 320.0)


class EngineCollector(Collector):
    """Exports the engine's latest stats snapshot: KV usage, blocks by state, queue sizes, engine counters."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.stats, self.model_name = stats, model_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.stats()
        labels, value = ["model_name"], [self.model_name]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"hafiza:{name}", doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"hafiza:{name}", doc, labels=labels)
            c.add_metric(value, v)
            return c

        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks held by running requests (1 = full).",
                    s.kv_cache_usage_perc)
        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting for admission.", s.num_waiting)
        blocks = GaugeMetricFamily("hafiza:kv_blocks", "KV blocks by state (pinned overlaps cached and in_use).",
                                   labels=[*labels, "state"])
        for state in ("free", "cached", "in_use", "pinned"):
            blocks.add_metric([*value, state], getattr(s.blocks, state))
        yield blocks
        yield gauge("kv_blocks_total", "KV blocks in the pool.", s.blocks.total)
        yield gauge("kv_block_size_tokens", "Tokens per KV block.", s.blocks.block_size)
        yield gauge("kv_bytes_per_block", "Bytes of K and V per block, all layers.", s.bytes_per_block)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.blocks.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.blocks.prefix_cache_hits)
        yield counter("num_preemptions", "Requests preempted (recomputed later) for lack of KV blocks.",
                      s.num_preemptions)
        yield counter("kv_evictions", "Cached KV blocks evicted to make room.", s.blocks.evictions)
        yield counter("kv_pinned_evictions", "Pinned KV blocks evicted before their TTL (memory exhausted).",
                      s.blocks.pinned_evictions)
        yield counter("prompt_tokens", "Prompt tokens of finished requests.", s.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", s.generation_tokens)
        if s.spec is not None:
            yield counter("spec_decode_num_drafts", "Drafts verified (speculative decoding).", s.spec.num_drafts)
            yield counter("spec_decode_num_draft_tokens", "Tokens drafted.", s.spec.num_draft_tokens)
            yield counter("spec_decode_num_accepted_tokens", "Drafted tokens accepted.", s.spec.num_accepted_tokens)
            per_pos = CounterMetricFamily("hafiza:spec_decode_num_accepted_tokens_per_pos",
                                          "Drafts whose token at this position was accepted.",
                                          labels=[*labels, "position"])
            for pos, n in enumerate(s.spec.accepted_per_position):
                per_pos.add_metric([*value, str(pos)], n)
            yield per_pos


class ServerMetrics:
    """Request-level metrics the HTTP layer records, plus the engine collector, on one registry."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str, prices: PriceTable,
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.prices = prices
        self.registry.register(EngineCollector(stats, model_name))
        ns = "hafiza"
        self.requests = Counter(f"{ns}:request_success", "Requests answered, by API and finish reason.",
                                ["api", "finished_reason"], registry=self.registry)
        self.errors = Counter(f"{ns}:request_errors", "Requests refused or failed, by API and HTTP status.",
                              ["api", "status"], registry=self.registry)
        self.request_prompt_tokens = Counter(f"{ns}:request_prompt_tokens", "Prompt tokens of answered requests.",
                                             ["api"], registry=self.registry)
        self.request_generation_tokens = Counter(f"{ns}:request_generation_tokens",
                                                 "Tokens generated for answered requests.", ["api"],
                                                 registry=self.registry)
        self.ttft = Histogram(f"{ns}:time_to_first_token_seconds", "Arrival at the engine to first token.",
                              ["api"], buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram(f"{ns}:inter_token_latency_seconds", "Time between consecutive streamed outputs.",
                             ["api"], buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram(f"{ns}:e2e_request_latency_seconds", "Arrival at the engine to the last token.",
                             ["api"], buckets=E2E_BUCKETS, registry=self.registry)
        self.cache_read = Counter(f"{ns}:cache_read_tokens", "Prompt tokens served from the prefix cache.",
                                  ["api"], registry=self.registry)
        self.cache_write = Counter(f"{ns}:cache_write_tokens", "Prompt tokens written for a cache breakpoint.",
                                   ["ttl"], registry=self.registry)
        self.cost = Counter(f"{ns}:prompt_cost", "Estimated prompt cost under the price table, with caching.",
                            ["api"], registry=self.registry)
        self.uncached_cost = Counter(f"{ns}:prompt_cost_uncached", "Estimated prompt cost had every prompt token "
                                     "been billed at the input price.", ["api"], registry=self.registry)
        self.saved = Gauge(f"{ns}:cache_cost_saved", "Estimated cost saved by caching since start: uncached cost "
                           "minus cost (write premiums make it negative until reads pay them back).", ["api"],
                           registry=self.registry)
        self.queue_time = Histogram(f"{ns}:request_queue_time_seconds", "Arrival at the engine to the first "
                                    "scheduled step (time spent waiting for admission).", buckets=QUEUE_BUCKETS,
                                    registry=self.registry)
        self.disconnects = Counter(f"{ns}:client_disconnects", "Requests aborted because the client went away.",
                                   ["api"], registry=self.registry)

    def record_usage(self, api: str, usage: CacheUsage) -> None:
        """Count one request's cache reads/writes and their estimated cost and savings."""
        self.cache_read.labels(api).inc(usage.cache_read)
        if usage.write_5m:
            self.cache_write.labels("5m").inc(usage.write_5m)
        if usage.write_1h:
            self.cache_write.labels("1h").inc(usage.write_1h)
        self.cost.labels(api).inc(usage.cost(self.prices))
        self.uncached_cost.labels(api).inc(usage.uncached_cost(self.prices))
        self.saved.labels(api).inc(usage.saved(self.prices))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
