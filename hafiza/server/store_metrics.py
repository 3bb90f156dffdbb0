"""Prometheus export of the KV store: the tier stack's collector (reads `TieredStore.stats()` at scrape time) and
the connector's own counters, on the server's registry."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from hafiza.store.connector import StoreConnector
from hafiza.store.tiered import TieredStats, TieredStore

_COUNTERS = (
    ("hits", "Store gets that returned a value.", "hits"),
    ("misses", "Store gets that returned nothing (absent, damaged or tier unavailable).", "misses"),
    ("puts", "Values stored.", "puts"),
    ("rejected", "Puts refused without error (too large, tier disabled or degraded).", "rejected"),
    ("errors", "I/O, connection and integrity failures.", "errors"),
    ("evictions", "Entries dropped to stay under the byte cap.", "evictions"),
    ("read_bytes", "Stored bytes read by gets.", "bytes_read"),
    ("written_bytes", "Stored bytes written by puts.", "bytes_written"),
)


class StoreCollector(Collector):
    """Per-tier gauges, counters and latency histograms under `hafiza:store_*`, labelled by tier."""

    def __init__(self, store: TieredStore):
        self.store = store

    def describe(self) -> Iterator[Metric]:
        """The metric families without samples, so registering does not touch the tiers."""
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        return self._families(self.store.stats())

    def _families(self, st: TieredStats | None) -> Iterator[Metric]:
        labels = ["tier", "kind"]

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"hafiza:store_{name}", doc, labels=labels)

        gauges = {
            "entries": gauge("entries", "Entries held by the tier."),
            "bytes": gauge("bytes", "Bytes held by the tier."),
            "capacity": gauge("capacity_bytes", "Byte cap of the tier."),
            "enabled": gauge("enabled", "1 while the tier accepts writes."),
            "degraded": gauge("degraded", "1 while the tier's server is unreachable."),
            "ratio": gauge("compression_ratio", "Raw KV bytes / stored bytes written."),
            "bandwidth": GaugeMetricFamily(
                "hafiza:store_load_bandwidth_bytes_per_second",
                "Load bandwidth the cost model uses (measured, or the default).",
                labels=labels,
            ),
        }
        counters = {
            attr: CounterMetricFamily(f"hafiza:store_{metric}", doc, labels=labels) for metric, doc, attr in _COUNTERS
        }
        lookup_hits = CounterMetricFamily(
            "hafiza:store_lookup_hits", "Leading prefix keys a lookup found in the tier.", labels=labels
        )
        load = HistogramMetricFamily("hafiza:store_load_seconds", "Latency of gets that hit.", labels=labels)
        save = HistogramMetricFamily("hafiza:store_save_seconds", "Latency of stored puts.", labels=labels)
        queue_depth = GaugeMetricFamily("hafiza:store_write_queue_depth", "Writes waiting for the writer.")
        dropped = CounterMetricFamily("hafiza:store_writes_dropped", "Writes dropped: the queue was full.")
        lookups = CounterMetricFamily("hafiza:store_lookups", "Prefix lookups.")
        lookup_keys = CounterMetricFamily("hafiza:store_lookup_keys", "Keys asked by prefix lookups.")
        if st is not None:
            for rep in st.tiers:
                s = rep.stats
                lv = [s.name, s.kind]
                if s.entries is not None:
                    gauges["entries"].add_metric(lv, s.entries)
                if s.bytes is not None:
                    gauges["bytes"].add_metric(lv, s.bytes)
                if s.capacity_bytes is not None:
                    gauges["capacity"].add_metric(lv, s.capacity_bytes)
                gauges["enabled"].add_metric(lv, float(s.enabled))
                gauges["degraded"].add_metric(lv, float(s.degraded))
                if rep.compression_ratio is not None:
                    gauges["ratio"].add_metric(lv, rep.compression_ratio)
                gauges["bandwidth"].add_metric(lv, rep.bandwidth_bytes_per_s)
                for attr, fam in counters.items():
                    fam.add_metric(lv, getattr(s, attr))
                lookup_hits.add_metric(lv, rep.lookup_hits)
                load.add_metric(lv, s.load_seconds.cumulative(), s.load_seconds.sum)
                save.add_metric(lv, s.store_seconds.cumulative(), s.store_seconds.sum)
            queue_depth.add_metric([], st.queue_depth)
            dropped.add_metric([], st.writes_dropped)
            lookups.add_metric([], st.lookups)
            lookup_keys.add_metric([], st.lookup_keys)
        yield from gauges.values()
        yield from counters.values()
        yield from (lookup_hits, load, save, queue_depth, dropped, lookups, lookup_keys)


def register_store_metrics(registry: CollectorRegistry, store: TieredStore) -> StoreCollector:
    """Expose `store`'s metrics on `registry`; returns the collector (unregister it on shutdown)."""
    collector = StoreCollector(store)
    registry.register(collector)
    return collector


class ConnectorCollector(Collector):
    """The connector's own counters: saves skipped or dropped, blocks loaded, corrupt blocks, decisions."""

    def __init__(self, connector: StoreConnector) -> None:
        self.connector = connector

    def collect(self) -> Iterator[Metric]:
        s = self.connector.stats
        for name, doc, value in (
            ("store_saves", "Full blocks handed to the store connector.", s.saves),
            ("store_saves_skipped", "Blocks not written: every tier already held them.", s.saves_skipped),
            ("store_saves_dropped", "Blocks not written: the store's write queue was full.", s.saves_dropped),
            ("store_encode_errors", "Blocks the codec failed to encode.", s.encode_errors),
            ("store_lookup_errors", "Admission lookups that failed inside the store (answered as misses).",
             s.lookup_errors),
            ("store_blocks_loaded", "Blocks loaded from the tiers into the pool.", s.blocks_loaded),
            ("store_blocks_corrupt", "Loaded blocks that failed the codec's checks (dropped, recomputed).",
             s.blocks_corrupt),
            ("store_prediction_mismatches", "Speculative blocks whose predictor rerun differed here (recomputed).",
             s.prediction_mismatches),
            ("store_decode_fallbacks", "Loads that ended at a block failing to decode (the rest recomputed).",
             s.decode_fallbacks),
            ("store_predictor_seconds", "Wall seconds spent rerunning the speculative codec's predictor.",
             s.predictor_seconds),
        ):
            c = CounterMetricFamily(f"hafiza:{name}", doc)
            c.add_metric([], value)
            yield c
        decisions = CounterMetricFamily("hafiza:store_decisions", "Admission lookups by outcome.",
                                        labels=["decision"])
        for decision, count in s.decisions.items():
            decisions.add_metric([decision], count)
        yield decisions
        encodes = CounterMetricFamily("hafiza:store_encodes", "Blocks encoded for the tiers, by codec (a speculative "
                                      "tier's blocks the cost model would not load predicted are in its fallback "
                                      "codec).", labels=["codec"])
        for codec, count in sorted(s.encodes.items()):
            encodes.add_metric([codec], count)
        yield encodes
        waits = CounterMetricFamily("hafiza:store_encode_waits", "Speculative encodes that waited for the engine "
                                    "to go idle.")
        waits.add_metric([], self.connector.gate.waits)
        yield waits
        pending = GaugeMetricFamily("hafiza:store_encode_queue_bytes",
                                    "Bytes waiting in the store's write queue (raw size of blocks not yet encoded).")
        pending.add_metric([], self.connector.store.stats().queue_bytes)
        yield pending
