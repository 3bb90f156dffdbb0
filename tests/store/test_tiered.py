"""TieredStore over real tiers (RAM → disk → Redis): lookup, load, the one background writer, cost model."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hafiza.store.cost import CostModel
from hafiza.store.disk import DiskStore
from hafiza.store.memory import MemoryStore
from hafiza.store.redis_store import RedisStore
from hafiza.store.tiered import Fallback, TieredStore
from tests.support.redis_server import RedisServer

from .conftest import unique_prefix


@pytest.fixture
def stack(tmp_path: Path, redis_server: RedisServer) -> Iterator[TieredStore]:
    ram = MemoryStore(1 << 20, name="ram")
    disk = DiskStore(tmp_path / "disk", 1 << 20, name="disk")
    rds = RedisStore(redis_server.url, prefix=unique_prefix(), name="redis")
    ts = TieredStore([ram, disk, rds])
    yield ts
    rds.clear()
    ts.close()


def val(i: int) -> bytes:
    return f"block-{i}".encode() * 50


def test_write_through_reaches_every_tier(stack: TieredStore) -> None:
    for i in range(5):
        assert stack.put_async(f"k{i}", val(i), ttl_s=60.0)
    assert stack.flush(timeout=30)
    for tier in stack.tiers:
        assert [tier.get(f"k{i}") for i in range(5)] == [val(i) for i in range(5)]
    ttl = stack.tiers[2].ttl_s("k0")  # type: ignore[attr-defined]
    assert ttl is not None and 0 < ttl <= 60


def test_lookup_stops_at_first_miss_and_names_sources(stack: TieredStore) -> None:
    ram, disk, rds = stack.tiers
    keys = [f"k{i}" for i in range(7)]
    for i in (0, 1, 2, 6):
        ram.put(keys[i], val(i))
    disk.put(keys[3], val(3))
    rds.put(keys[4], val(4))
    rds.put(keys[1], val(1))  # also lower down: the fastest tier is named
    found = stack.lookup_prefix(keys)
    assert (found.num_keys, found.num_hits) == (7, 5)
    assert found.sources == ["ram", "ram", "ram", "disk", "redis"]
    assert found.per_tier() == {"ram": 3, "disk": 1, "redis": 1}
    assert stack.lookup_prefix([]).num_hits == 0
    s = stack.stats()
    assert (s.lookups, s.lookup_keys, s.lookup_hit_keys) == (2, 7, 5)
    assert [t.lookup_hits for t in s.tiers] == [3, 1, 1]


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    """Poll `condition` until it holds (True) or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_load_names_each_values_tier_and_leaves_promotion_to_the_caller(stack: TieredStore) -> None:
    ram, disk, rds = stack.tiers
    keys = ["a", "b", "c"]
    ram.put("a", val(0))
    disk.put("b", val(1))
    rds.put("c", val(2))
    got = stack.load(keys)
    assert got.values == [val(0), val(1), val(2)] and got.sources == [0, 1, 2]
    assert not ram.contains("b") and not disk.contains("c")  # the connector promotes (codecs may differ)


def test_per_tier_keys_and_value_functions(stack: TieredStore) -> None:
    stack.bind_keys(lambda j, name: f"{name}@{j}", lambda j, name: None)
    asked: list[int] = []

    def value_for(j: int) -> bytes | None:
        asked.append(j)
        return None if j == 1 else val(j)  # None: skip the disk tier

    assert stack.put_async("x", value_for, raw_nbytes=10, nbytes=10) and stack.flush(timeout=30)
    ram, disk, rds = stack.tiers
    assert asked == [0, 1, 2] and ram.get("x@0") == val(0) and rds.get("x@2") == val(2)
    assert not disk.contains("x@1") and not ram.contains("x")
    assert stack.lookup_prefix(["x"]).sources == ["ram"]
    assert stack.put_async("y", b"v", targets=[2]) and stack.flush(timeout=30)
    assert stack.lookup_prefix(["y"]).sources == ["redis"] and not ram.contains("y@0")


def test_a_failing_value_function_drops_the_job_not_the_writer(stack: TieredStore) -> None:
    def broken(j: int) -> bytes | None:
        raise RuntimeError("encoder failed")

    assert stack.put_async("bad", broken) and stack.put_async("good", val(1)) and stack.flush(timeout=30)
    assert stack.lookup_prefix(["bad", "good"]).num_hits == 0 and stack.lookup_prefix(["good"]).num_hits == 1


def test_load_returns_the_leading_run_actually_fetched(stack: TieredStore) -> None:
    _, disk, _ = stack.tiers
    keys = ["a", "b", "c"]
    for i, k in enumerate(keys):
        disk.put(k, val(i))
    assert stack.lookup_prefix(keys).num_hits == 3
    disk.path_of("b").write_bytes(b"damaged")  # vanished/damaged between lookup and load
    assert stack.load(keys).values == [val(0)]
    assert stack.load([]).values == []


def test_write_back_keeps_writes_in_ram_until_eviction_or_flush(tmp_path: Path) -> None:
    ram = MemoryStore(3 * 500, name="ram")
    disk = DiskStore(tmp_path, 1 << 20, name="disk")
    ts = TieredStore([ram, disk], write_back=True)
    for i in range(3):
        ts.put_async(f"k{i}", val(i))
    assert wait_until(lambda: all(ram.contains(f"k{i}") for i in range(3))) and disk.stats().entries == 0
    ts.put_async("k3", val(3))  # evicts k0 from RAM, which goes down to disk
    ts.flush(timeout=30)
    assert [disk.get(f"k{i}") for i in range(4)] == [val(i) for i in range(4)]
    ts.close()


def test_write_back_needs_ram_first(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="RAM tier first"):
        TieredStore([DiskStore(tmp_path, 1 << 20)], write_back=True)


class GatedStore(MemoryStore):
    """A RAM tier whose writes wait for a gate, to fill the writer's queue deterministically."""

    def __init__(self) -> None:
        super().__init__(1 << 20, name="gated")
        self.gate = threading.Event()

    def put(self, key: str, value: bytes, ttl_s: float | None = None) -> bool:
        self.gate.wait()
        return super().put(key, value, ttl_s)


def test_full_queue_drops_instead_of_blocking_and_flush_times_out() -> None:
    tier = GatedStore()
    ts = TieredStore([tier], queue_size=2)
    results = [ts.put_async(f"k{i}", b"v") for i in range(6)]
    # one job may already be taken by the writer (blocked on the gate), two more wait in the queue
    assert results[:2] == [True, True] and results[-1] is False
    assert ts.stats().writes_dropped == results.count(False) >= 3
    assert ts.flush(timeout=0.05) is False
    tier.gate.set()
    assert ts.flush(timeout=30) is True
    assert ts.stats().queue_depth == 0
    assert [tier.contains(f"k{i}") for i in range(6)] == results
    assert ts.close() is True
    assert ts.put_async("late", b"v") is False


def test_compression_ratio_and_per_tier_counters(stack: TieredStore) -> None:
    stack.put_async("k", b"x" * 1000, raw_nbytes=3000)
    stack.flush(timeout=30)
    s = stack.stats()
    assert [t.compression_ratio for t in s.tiers] == [3.0, 3.0, 3.0]
    assert [t.stats.puts for t in s.tiers] == [1, 1, 1]


def test_cost_model_defaults_then_measures(stack: TieredStore) -> None:
    bw, measured = stack.cost.bandwidth("disk")
    assert not measured and bw == 100e6
    no_rate = stack.cost.decide(2000, {"disk": 1_000_000})
    assert no_rate.load and "not measured" in no_rate.reason and no_rate.recompute_s is None
    stack.tiers[1].put("big", b"x" * 500_000)
    stack.load(["big"])
    bw, measured = stack.cost.bandwidth("disk")
    assert measured and bw > 0


def test_cost_model_decides_load_vs_recompute() -> None:
    cost = CostModel(defaults={"disk": 100e6, "redis": 10e6})
    cost.add_tier("disk", "disk")
    cost.add_tier("redis", "redis")
    cost.set_prefill_rate(1000.0)  # tokens/s
    fast = cost.decide(2000, {"disk": 10_000_000})  # 0.1 s load vs 2 s recompute
    assert fast.load and fast.load_s == pytest.approx(0.1) and fast.recompute_s == pytest.approx(2.0)
    assert fast.reason.startswith("load:") and "10.00 MB from disk" in fast.reason
    slow = cost.decide(100, {"redis": 10_000_000})  # 1 s load vs 0.1 s recompute
    assert not slow.load and slow.reason.startswith("recompute:")
    mixed = cost.decide(2000, {"disk": 10_000_000, "redis": 10_000_000})
    assert mixed.load_s == pytest.approx(1.1)
    assert not cost.decide(0, {"disk": 1}).load

    cost.observe_load("disk", 1_000_000, 0.001)  # 1 GB/s measured
    assert cost.bandwidth("disk") == (pytest.approx(1e9), True)
    cost.observe_load("disk", 1_000_000, 0.004)  # the average moves toward 250 MB/s
    bw, _ = cost.bandwidth("disk")
    assert 250e6 < bw < 1e9
    cost.observe_prefill(500, 1.0)
    assert 500 < cost.prefill_rate() < 1000  # type: ignore[operator]


def test_cost_model_plans_follow_their_inputs() -> None:
    """Load and decode, load plus predictor, or recompute: each as the measured speeds say."""
    cost = CostModel(defaults={"redis": 100e6})
    cost.add_tier("redis", "redis")
    cost.set_prefill_rate(1000.0)
    plain = cost.decide(1000, {"redis": 10_000_000}, decode_s=0.05)  # 0.1 + 0.05 s vs 1 s
    assert plain.load and plain.plan == "load" and plain.load_s == pytest.approx(0.15)
    unmeasured = cost.decide(1000, {"redis": 1_000_000}, predict_tokens=1000)
    assert unmeasured.load and unmeasured.plan == "predict" and "not measured" in unmeasured.reason
    cost.observe_predict(1000, 0.5)  # predictor at 2000 tok/s
    spec = cost.decide(1000, {"redis": 1_000_000}, predict_tokens=1000)  # 0.01 + 0.5 s vs 1 s
    assert spec.load and spec.plan == "predict" and spec.reason.startswith("load: predict+decode:")
    assert spec.load_s == pytest.approx(0.51)
    cost.set_prefill_rate(1500.0)  # prefill faster: 0.67 s still beats 0.51 s … until it is faster still
    assert cost.decide(1000, {"redis": 1_000_000}, predict_tokens=1000).plan == "predict"
    cost.set_prefill_rate(5000.0)
    fast = cost.decide(1000, {"redis": 1_000_000}, predict_tokens=1000)
    assert not fast.load and fast.plan == "recompute" and "predictor on 1000 tokens" in fast.reason
    cost.observe_load("redis", 1_000_000, 1.0)  # the tier becomes slow: 1 MB/s
    assert cost.decide(1000, {"redis": 1_000_000}).plan == "recompute"


def test_queue_is_bounded_in_bytes_too() -> None:
    tier = GatedStore()
    ts = TieredStore([tier], queue_size=100, max_pending_bytes=1000)
    assert ts.put_async("huge", b"x" * 5000)  # alone in the queue: always accepted
    assert ts.put_async("more", b"y") is False
    tier.gate.set()
    assert ts.flush(timeout=30)
    assert ts.put_async("a", b"a" * 600) and ts.put_async("b", b"b" * 300)
    ts.close()


def test_contended_speeds_do_not_change_the_decision_once_quiet_ones_are_measured() -> None:
    """The same quiet measurements give the same plan whatever the writer did meanwhile (injected timings)."""
    quiet, noisy = CostModel(), CostModel()
    for cost in (quiet, noisy):
        cost.add_tier("redis", "redis")
        cost.observe_load("redis", 10_000_000, 0.05)
    for tokens, seconds in ((1000, 1.0), (1000, 1.2), (500, 0.5)):
        quiet.observe_prefill(tokens, seconds)
        noisy.observe_prefill(tokens, seconds)
        noisy.observe_prefill(tokens, seconds * 5, contended=True)  # the writer was encoding: prefill looks slow
    for tokens, seconds in ((2000, 1.0), (1000, 0.5)):
        quiet.observe_predict(tokens, seconds)
        noisy.observe_predict(tokens, seconds)
        noisy.observe_predict(tokens, seconds * 7, contended=True)  # the engine was serving: predictor looks slow
    assert noisy.prefill_rate() == quiet.prefill_rate() and noisy.predict_rate() == quiet.predict_rate()
    for n in (16, 256, 2000):
        a = quiet.decide(n, {"redis": n * 6000}, 0.001, n)
        b = noisy.decide(n, {"redis": n * 6000}, 0.001, n)
        assert (a.plan, a.reason, a.load_s) == (b.plan, b.reason, b.load_s)


def test_contended_speeds_are_used_only_until_a_quiet_one_exists() -> None:
    cost = CostModel()
    cost.observe_prefill(1000, 4.0, contended=True)
    assert cost.prefill_rate() == pytest.approx(250.0)
    cost.observe_prefill(1000, 1.0)
    assert cost.prefill_rate() == pytest.approx(1000.0)
    cost.observe_predict(100, 1.0, contended=True)
    assert cost.predict_rate() == pytest.approx(100.0)
    cost.set_predict_rate(900.0)
    assert cost.predict_rate() == pytest.approx(900.0)


def test_fallback_key_holds_what_the_value_function_marks_and_lookup_and_load_say_so() -> None:
    ram = MemoryStore(1 << 20)
    ts = TieredStore([ram], key_of=lambda j, name: f"spec:{name}",
                     fallback_key_of=lambda j, name: f"fast:{name}")
    assert ts.put_async("a", lambda j: b"predicted")
    assert ts.put_async("b", lambda j: Fallback(b"plain"))
    assert ts.flush(timeout=30)
    assert ram.get("spec:a") == b"predicted" and ram.get("fast:b") == b"plain" and ram.get("spec:b") is None
    found = ts.lookup_prefix(["a", "b", "c"])
    assert (found.num_hits, found.sources, found.fallback) == (2, ["ram", "ram"], [False, True])
    loaded = ts.load(["a", "b"])
    assert (loaded.values, loaded.fallback) == ([b"predicted", b"plain"], [False, True])
    bare = TieredStore([MemoryStore(1 << 20)])  # no fallback key: a Fallback value drops the job, not the writer
    assert bare.put_async("x", lambda j: Fallback(b"v")) and bare.put_async("y", b"w")
    assert bare.flush(timeout=30) and bare.lookup_prefix(["y"]).num_hits == 1
    assert bare.lookup_prefix(["x"]).num_hits == 0
    ts.close()
    bare.close()
