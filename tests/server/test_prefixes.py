"""PrefixIndex: the cached prefixes listed from the block manager's chain links, on a tiny model's engine."""

from __future__ import annotations

from hafiza.engine import EngineConfig, LLMEngine, SamplingParams
from hafiza.models import LoadedModel
from hafiza.server.prefixes import PrefixIndex

BS = 4
SHARED = list(range(300, 316))  # 4 blocks both prompts start with
A = [*SHARED, *range(400, 408)]
B = [*SHARED, *range(500, 508)]
FILL = SamplingParams(max_tokens=0)  # computes the prompt, registers its full blocks, finishes in one step


def engine_with(lm: LoadedModel) -> LLMEngine:
    return LLMEngine(lm, EngineConfig(kv_memory="4MiB", kv_dtype="model", block_size=BS))


def rows(index: PrefixIndex) -> dict[str, dict]:
    return {r["head"]: r for r in index.snapshot()["prefixes"]}


def test_chains_come_from_the_pool_and_drop_keeps_the_shared_part(tiny_llama: LoadedModel) -> None:
    engine = engine_with(tiny_llama)
    index = PrefixIndex(engine)
    decode = tiny_llama.tokenizer.decode
    engine.generate([A], FILL)
    engine.generate([B], FILL)
    snap = index.snapshot()
    assert snap["count"] == 2 and snap["unattributed_cached_blocks"] == 0
    a, b = rows(index)[decode(A)], rows(index)[decode(B)]
    for r in (a, b):
        assert (r["tokens"], r["blocks"], r["resident_blocks"], r["stranded_blocks"]) == (24, 6, 6, 0)
        assert r["shared_tokens"] == 16 and r["requests"] == 1 and r["in_use_blocks"] == 0
        assert r["bytes"] == 6 * engine.bytes_per_block
    assert engine.generate([A], FILL)[0].num_cached_tokens == 20  # hits 5 blocks; the 6th is computed again
    assert rows(index)[decode(A)]["requests"] == 2

    report, hashes = index.drop(a["id"])
    assert report["dropped_blocks"] == 2 and report["kept_shared_blocks"] == 4 and len(hashes) == 2
    assert list(rows(index)) == [decode(B)]
    engine.check_integrity()
    assert engine.generate([A], FILL)[0].num_cached_tokens == 16  # only the shared blocks were left


def test_a_chain_without_its_first_block_is_stranded(tiny_llama: LoadedModel) -> None:
    engine = engine_with(tiny_llama)
    index = PrefixIndex(engine)
    engine.generate([A], FILL)
    root = next(link for link in engine.blocks.chains() if link.position == 0)
    assert engine.blocks.drop([root.hash]) == 1
    (r,) = index.snapshot()["prefixes"]
    assert (r["tokens"], r["blocks"], r["resident_blocks"], r["stranded_blocks"]) == (0, 6, 5, 5)
    assert engine.generate([A], FILL)[0].num_cached_tokens == 0
    engine.check_integrity()
