"""The speculative tier's writer on a real engine with frozen (injected) speeds: which codec each block gets, said
in `x-hafiza-tiers` and the metrics, and a request's prefill never sharing the CPU with an encode that started
after it (asserted on the order of the gate's events, not on timings)."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, generate_latest

from hafiza.engine import LLMEngine
from hafiza.models import LoadedModel
from hafiza.server.store_metrics import ConnectorCollector
from hafiza.server.tiers import tiers_header
from hafiza.store.connector import StoreConnector
from hafiza.store.memory import MemoryStore
from hafiza.store.tiered import TieredStore

from .engine_support import GREEDY, cold, engine_with, frozen, prompt_ids, serve

N = 72  # 4 full 16-token blocks are saved and can come back from the store
BS = 16


def speculative_engine(model: LoadedModel, ram: MemoryStore) -> tuple[LLMEngine, StoreConnector]:
    engine, conn = engine_with(model, TieredStore([ram]), codec="speculative")
    assert conn is not None
    return engine, conn


def encodes_metric(conn: StoreConnector) -> str:
    registry = CollectorRegistry()
    registry.register(ConnectorCollector(conn))
    return generate_latest(registry).decode()


def test_injected_speeds_choose_the_codec_and_header_and_metrics_say_which(tiny_llama: LoadedModel) -> None:
    ids = prompt_ids(tiny_llama, N)
    reference = cold(tiny_llama, ids)
    for predict_tps, codec, label in ((1e-3, "fast", "ram.fast"), (1e9, "speculative", "ram")):
        ram = MemoryStore(64 << 20, name="ram")
        a_engine, a = speculative_engine(tiny_llama, ram)
        frozen(a, prefill_tps=1.0, predict_tps=predict_tps)  # 1 token/s: any load beats recompute
        assert serve(a_engine, ids).tokens == reference and a.flush()
        assert a.stats.encodes == {codec: N // BS}, predict_tps
        assert f'hafiza:store_encodes_total{{codec="{codec}"}} {float(N // BS)}' in encodes_metric(a)

        b_engine, b = speculative_engine(tiny_llama, ram)
        frozen(b, prefill_tps=1.0, predict_tps=predict_tps)
        b_engine.add_request(ids, GREEDY)
        outs = [out for _ in range(100) if b_engine.has_unfinished() for out in b_engine.step()]
        assert f"{label}={(N - 1) // BS * BS};" in tiers_header(outs[0]), tiers_header(outs[0])
        assert [t for out in outs for t in out.new_token_ids] == reference
        plan = "predict" if codec == "speculative" else "load"
        assert b.stats.decisions[plan] == 1 and b.stats.decode_fallbacks == 0
        a.close()
        b.close()


def test_a_request_arriving_mid_pass_gets_the_cpu_after_one_chunk_and_no_encode_starts_during_it(
        tiny_llama: LoadedModel) -> None:
    """The writer runs a prompt's predictor pass one 16-token chunk per gate slice. Request B arrives while a slice
    runs: that slice ends, and no further slice starts until B is done."""
    events: list[str] = []
    lock = threading.Lock()
    b_arrived, slice_running = threading.Event(), threading.Event()

    def record(name: str) -> None:
        with lock:
            events.append(name)
        if name == "serve" and slice_running.is_set():
            b_arrived.set()

    engine, conn = speculative_engine(tiny_llama, MemoryStore(64 << 20, name="ram"))
    frozen(conn, prefill_tps=1.0, predict_tps=1e9)
    assert conn.predictor is not None
    kv = conn.predictor.kv
    kv.chunk = BS  # one block per slice: a 64-token pass is several slices
    inner = kv.on_run
    main = threading.current_thread()

    def on_run(tokens: int, seconds: float) -> None:
        if inner is not None:
            inner(tokens, seconds)
        if threading.current_thread() is not main and not slice_running.is_set():
            slice_running.set()
            assert b_arrived.wait(60), "request B never started"  # hold the first slice until B is serving
            record("first-slice-returns")

    kv.on_run = on_run
    conn.gate.on_event = record
    a_ids, b_ids = prompt_ids(tiny_llama, N), prompt_ids(tiny_llama, N, offset=200)
    assert serve(engine, a_ids).tokens == cold(tiny_llama, a_ids)
    assert slice_running.wait(60), "the writer never started A's encode"
    with lock:
        events.append("B-added")
    got = serve(engine, b_ids)
    assert got.tokens == cold(tiny_llama, b_ids)
    assert conn.flush()
    conn.close()

    b_start = events.index("serve", events.index("B-added"))
    b_end = events.index("idle", b_start)
    during_b = events[b_start:b_end]
    assert "encode" not in during_b, events  # no slice starts while B is prefilled or decoded
    assert "first-slice-returns" in during_b and "encoded" in during_b  # the running slice only finishes
    assert "encode" in events[b_end:]  # the rest of A's pass (and B's) runs once B is done
    assert conn.gate.waits >= 1 and conn.stats.encodes.get("speculative", 0) == 2 * (N // BS)
    assert events.count("encode") >= 2 * 2 * (N // BS)  # per prompt: its 4 predictor chunks, then 4 block encodes
    busy = False
    for name in events:  # over the whole run: an encode slice never starts while the engine serves
        busy = {"serve": True, "idle": False}.get(name, busy)
        assert not (busy and name == "encode"), events
