"""Helpers for engine-level store tests: an engine with a connector, one request run to completion."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hafiza.engine import CachePin, EngineConfig, LLMEngine, SamplingParams
from hafiza.engine.connector import TierOutcome
from hafiza.models import LoadedModel
from hafiza.store.connector import StoreConnector
from hafiza.store.tiered import TieredStore

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
TEXT = Path(__file__).resolve().parents[2] / "bench" / "texts" / "en_declaration_gettysburg.txt"


def prompt_ids(model: LoadedModel, n: int, offset: int = 0) -> list[int]:
    """`n` tokens of real English prose (the benchmark text), starting `offset` tokens in."""
    ids = model.tokenizer.encode(TEXT.read_text())
    assert len(ids) >= offset + n, f"benchmark text has only {len(ids)} tokens"
    return ids[offset : offset + n]


@dataclass
class Served:
    """One finished request: its tokens and what the last output said about the cache."""

    tokens: list[int]
    cached: int
    external: int
    sources: dict[str, int] = field(default_factory=dict)
    decision: str = ""


def engine_with(model: LoadedModel, store: TieredStore | None, kv_memory: str = "64MiB", kv_dtype: str = "auto",
                **connector_opts) -> tuple[LLMEngine, StoreConnector | None]:
    """A fresh engine (own pool of `kv_dtype`) with `store` attached through a StoreConnector."""
    engine = LLMEngine(model, EngineConfig(kv_memory=kv_memory, kv_dtype=kv_dtype))
    if store is None:
        return engine, None
    connector = StoreConnector.for_engine(engine, store, **connector_opts)
    engine.attach_connector(connector)
    return engine, connector


def frozen(conn: StoreConnector, prefill_tps: float, predict_tps: float) -> None:
    """Fix the cost model's speeds (the engine's and the writer's measurements are ignored): an injected clock, so
    which codec a block gets and whether a hit is loaded do not follow the machine's load."""
    cost = conn.store.cost
    cost.set_prefill_rate(prefill_tps)
    cost.set_predict_rate(predict_tps)
    cost.observe_prefill = lambda *a, **k: None  # type: ignore[method-assign]
    cost.observe_predict = lambda *a, **k: None  # type: ignore[method-assign]


def serve(engine: LLMEngine, ids: list[int], params: SamplingParams = GREEDY, pins: tuple[CachePin, ...] = ()
          ) -> Served:
    """Run one request to completion."""
    engine.add_request(ids, params, pins=pins)
    tokens: list[int] = []
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            last = out
    assert last is not None and last.finished
    t = last.tiers or TierOutcome()
    return Served(tokens, last.num_cached_tokens, t.loaded_tokens, dict(t.per_tier),
                  t.reason if t.decision != "none" else "")


def cold(model: LoadedModel, ids: list[int], params: SamplingParams = GREEDY, kv_dtype: str = "auto") -> list[int]:
    """The reference: the same request on an engine with no store."""
    return serve(engine_with(model, None, kv_dtype=kv_dtype)[0], ids, params).tokens
