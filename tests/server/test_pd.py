"""The prefill/decode split's parts without the router: kv_transfer_params parsing (a bad shape is a 400 naming
the field), `--role` refusals, a decode's forced load against a cost model that says recompute, and what a prefill
reports stored."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from hafiza.models import LoadedModel
from hafiza.server.errors import ApiError
from hafiza.server.pd import PARAM, PDWorker, Transfer, parse_transfer
from hafiza.store.memory import MemoryStore
from hafiza.store.tiered import TieredStore
from tests.store.engine_support import cold, engine_with, prompt_ids, serve
from tests.support.serve import run_cli

TAIL = "0123456789abcdef0123456789abcdef"
N = 120  # tokens: 7 full blocks of 16
BS = 16


@pytest.mark.parametrize(("value", "role", "stream", "why"), [
    ({"do_remote_decode": True}, "both", False, "no prefill/decode split"),
    ([1, 2], "decode", False, "must be an object"),
    ("yes", "prefill", False, "must be an object"),
    ({"do_remote_decode": "yes"}, "prefill", False, "do_remote_decode must be true or false"),
    ({"do_remote_decode": True, "do_remote_prefill": True}, "prefill", False, "cannot both be true"),
    ({"do_remote_decode": True}, "decode", False, "this worker runs --role decode"),
    ({"do_remote_decode": True}, "prefill", True, "needs stream false"),
    ({"do_remote_prefill": True, "hafiza_blocks": 2, "hafiza_hashes_tail": TAIL}, "prefill", False,
     "this worker runs --role prefill"),
    ({"do_remote_prefill": True}, "decode", False, "hafiza_blocks must be a non-negative integer"),
    ({"do_remote_prefill": True, "hafiza_blocks": -1}, "decode", False, "hafiza_blocks"),
    ({"do_remote_prefill": True, "hafiza_blocks": True}, "decode", False, "hafiza_blocks"),
    ({"do_remote_prefill": True, "hafiza_blocks": 2, "hafiza_hashes_tail": "xyz"}, "decode", False,
     "hafiza_hashes_tail"),
    ({"do_remote_prefill": True, "hafiza_blocks": 2, "hafiza_hashes_tail": TAIL, "remote_host": "10.0.0.1"},
     "decode", False, "NIXL"),
    ({"do_remote_prefill": True, "hafiza_blocks": 0, "remote_engine_id": 7}, "decode", False, "remote_engine_id"),
])
def test_a_bad_transfer_is_a_400_naming_kv_transfer_params(value: object, role: str, stream: bool, why: str) -> None:
    with pytest.raises(ApiError) as exc:
        parse_transfer(value, role, stream)
    assert exc.value.status == 400 and exc.value.param == PARAM
    assert exc.value.message.startswith(f"{PARAM}: ") and why in exc.value.message


def test_transfers_a_role_takes_are_parsed() -> None:
    assert parse_transfer(None, "both") is None
    assert parse_transfer({"do_remote_decode": False, "do_remote_prefill": False}, "decode") is None
    router = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}
    assert parse_transfer(router, "prefill") == Transfer(prefill=True)
    handed = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "hafiza-x",
              "hafiza_blocks": 3, "hafiza_hashes_tail": TAIL, "hafiza_prompt_blocks": 3}
    assert parse_transfer(handed, "decode") == Transfer(False, 3, TAIL, "hafiza-x")
    with pytest.raises(ApiError, match="one prompt"):
        parse_transfer(handed, "decode", prompts=2)


@pytest.mark.parametrize("args", [["--role", "prefill"], ["--role", "decode", "--store-ram", "1GiB"],
                                  ["--role", "sideways", "--store-redis", "redis://127.0.0.1:1"]])
def test_a_split_role_without_redis_or_an_unknown_role_is_a_usage_error(
        args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_cli(["serve", *args], monkeypatch, capsys)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--role" in lines[0], result.stderr


def decode_worker(model: LoadedModel, store: TieredStore, codec: str = "zstd") -> tuple[Any, PDWorker]:
    engine, conn = engine_with(model, store, codec=codec)
    assert conn is not None
    return engine, PDWorker("decode", engine, conn)


@pytest.mark.parametrize("codec", ["zstd", "speculative"])
def test_named_blocks_are_loaded_even_when_the_cost_model_says_recompute(tiny_llama: LoadedModel, codec: str
                                                                        ) -> None:
    ids = prompt_ids(tiny_llama, N)
    store = TieredStore([MemoryStore(64 << 20, name="redis")])
    first, conn = engine_with(tiny_llama, store, codec=codec)
    pre = PDWorker("prefill", first, conn)  # type: ignore[arg-type]
    serve(first, ids)
    stored = asyncio.run(pre.prefilled(ids, None))
    hashes = pre.prompt_hashes(ids, None)
    assert stored["hafiza_blocks"] == N // BS == stored["hafiza_prompt_blocks"]
    assert stored["hafiza_hashes_tail"] == hashes[-1] and "hafiza_note" not in stored

    store.cost.set_prefill_rate(1e15)  # recomputing is now "free": the cost model alone never loads
    second, pd = decode_worker(tiny_llama, store, codec)
    with pd.expecting(hashes):
        b = serve(second, ids)
    assert b.tokens == cold(tiny_llama, ids)
    assert b.external == (N - 1) // BS * BS and sum(b.sources.values()) == b.external
    assert set(b.sources) <= {"redis", "redis.fast"}
    assert b.decision.startswith("load: a prefill worker stored these blocks") and "recompute" in b.decision

    third, _ = decode_worker(tiny_llama, store, codec)
    c = serve(third, ids)  # not named: the cost model decides
    assert c.external == 0 and c.decision.startswith("recompute:")


def test_a_prefill_whose_blocks_did_not_reach_redis_says_so(tiny_llama: LoadedModel) -> None:
    ids = prompt_ids(tiny_llama, N)
    store = TieredStore([MemoryStore(64 << 20, name="redis")])
    engine, conn = engine_with(tiny_llama, store)
    pre = PDWorker("prefill", engine, conn)  # type: ignore[arg-type]
    serve(engine, ids)
    assert conn is not None and conn.flush()
    hashes = pre.prompt_hashes(ids, None)
    store.tiers[0].delete(conn.key(hashes[3]))
    stored = asyncio.run(pre.prefilled(ids, None))
    assert stored["hafiza_blocks"] == 3 and stored["hafiza_hashes_tail"] == hashes[2]
    assert "only 3 of the prompt's 7 full blocks are in Redis" in stored["hafiza_note"]
