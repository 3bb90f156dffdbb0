"""The prefill/decode split through the shared Redis tier (`hafiza serve --role prefill|decode`), as vllm-router's
`--vllm-pd-disaggregation` drives it.

The router sends a request first to a prefill worker, with `max_tokens: 1` and `kv_transfer_params:
{"do_remote_decode": true, ...}`. That worker computes the prompt, waits until every full block of it is written
through to Redis (whatever codec each tier has: it polls Redis until the store's writer has written them, or has
nothing left to write), and names the leading blocks Redis holds in its response's top-level `kv_transfer_params`:
`{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": ..., "remote_block_ids": null,
"remote_host": null, "remote_port": null, "hafiza_blocks": N, "hafiza_hashes_tail": <block N's hash>}`.
The router passes that object unchanged to the decode worker with the original request. The decode worker checks
that its own hash of the prompt's block N is `hafiza_hashes_tail` (same tokens, cache partition, model, KV dtype
and block size), then loads those blocks at admission whatever the load-versus-recompute cost model says
(`StoreConnector.must_load`). Blocks that are missing or fail to decode are recomputed, and the answer says so:
`x-hafiza-tiers` gains `remote=...` and the decode response's `kv_transfer_params` carries `hafiza_loaded_blocks`,
`hafiza_recomputed_blocks` and `hafiza_note`.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hafiza.cache.hashing import chain_hashes
from hafiza.errors import HafizaError
from hafiza.server.errors import ApiError

if TYPE_CHECKING:
    from hafiza.engine.engine import LLMEngine
    from hafiza.engine.results import RequestOutput
    from hafiza.store.connector import StoreConnector

ROLES = ("both", "prefill", "decode")
PARAM = "kv_transfer_params"
FLUSH_TIMEOUT_S = 30.0
HASH = re.compile(r"[0-9a-f]{32}")
# vLLM's NIXL connector fields: they name a transport this server does not use, so only null is accepted
VLLM_NULLS = ("remote_block_ids", "remote_host", "remote_port", "remote_request_id", "tp_size")


def check_role(role: str, store_redis: str | None) -> None:
    """A one-line usage error for an unknown role, or a split role without the shared Redis tier."""
    if role not in ROLES:
        raise HafizaError(f"--role must be one of {', '.join(ROLES)}, got {role!r}")
    if role != "both" and store_redis is None:
        raise HafizaError(f"--role {role} needs --store-redis: prefill and decode workers hand the prompt's KV "
                          f"blocks over through the shared Redis tier")


@dataclass(frozen=True)
class Transfer:
    """What a request's kv_transfer_params ask: `prefill` (compute the prompt and store its blocks for a decode
    worker) or, for a decode, the `blocks` leading blocks a prefill worker stored, the last one's hash `tail`."""

    prefill: bool
    blocks: int = 0
    tail: str | None = None
    engine_id: str | None = None


def _bad(message: str) -> ApiError:
    return ApiError(400, f"{PARAM}: {message}", param=PARAM)


def parse_transfer(value: object, role: str, stream: bool = False, prompts: int = 1) -> Transfer | None:
    """The request's transfer (None when there is none), or a 400 naming kv_transfer_params for a bad shape or
    one this worker's role does not take."""
    if value is None:
        return None
    if role == "both":
        raise _bad("this server has no prefill/decode split (KV transfer; start workers with --role prefill or "
                   "--role decode); send null or leave it out")
    if not isinstance(value, dict):
        raise _bad(f"must be an object, got {type(value).__name__}")
    for key in ("do_remote_decode", "do_remote_prefill"):
        if value.get(key) is not None and not isinstance(value[key], bool):
            raise _bad(f"{key} must be true or false")
    for key in VLLM_NULLS:
        if value.get(key) not in (None, [], 0) and not (key == "tp_size" and value[key] == 1):
            raise _bad(f"{key} names a NIXL transfer; this server hands blocks over through Redis (send null)")
    engine_id = value.get("remote_engine_id")
    if engine_id is not None and not isinstance(engine_id, str):
        raise _bad("remote_engine_id must be a string or null")
    decode, prefill = bool(value.get("do_remote_decode")), bool(value.get("do_remote_prefill"))
    if decode and prefill:
        raise _bad("do_remote_decode and do_remote_prefill cannot both be true")
    if not decode and not prefill:
        return None
    if prompts != 1:
        raise _bad(f"a transfer names the blocks of one prompt, got {prompts} prompts")
    if decode:
        if role != "prefill":
            raise _bad("do_remote_decode asks for a prefill, and this worker runs --role decode")
        if stream:
            raise _bad("do_remote_decode needs stream false (the stored blocks are named in the response body)")
        return Transfer(prefill=True)
    if role != "decode":
        raise _bad("do_remote_prefill asks for a decode, and this worker runs --role prefill")
    blocks, tail = value.get("hafiza_blocks"), value.get("hafiza_hashes_tail")
    if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 0:
        raise _bad("hafiza_blocks must be a non-negative integer (the blocks the prefill worker stored)")
    if blocks and not (isinstance(tail, str) and HASH.fullmatch(tail)):
        raise _bad("hafiza_hashes_tail must be the last stored block's hash (32 hex digits)")
    return Transfer(prefill=False, blocks=blocks, tail=tail if blocks else None, engine_id=engine_id)


class PDWorker:
    """One worker's side of the split: its role, the prompt blocks a decode must load (the connector's
    `must_load` hook), and what a prefill stored."""

    def __init__(self, role: str, engine: LLMEngine, connector: StoreConnector) -> None:
        """Attach to `connector` (before the engine thread starts); it must have a Redis tier."""
        if "redis" not in connector.store.names:
            raise HafizaError(f"--role {role} needs --store-redis (the tiers are {connector.store.names})")
        self.role, self.engine, self.connector = role, engine, connector
        self.tier = connector.store.names.index("redis")
        self.engine_id = f"hafiza-{uuid.uuid4().hex[:16]}"
        self._expected: Counter[str] = Counter()
        self._lock = threading.Lock()
        connector.must_load = self._must_load

    def prompt_hashes(self, ids: Sequence[int], cache_salt: str | None) -> list[str]:
        """The chained hashes of the prompt's full blocks, as the engine keys them (model, KV dtype, block size,
        cache partition)."""
        salt = cache_salt if cache_salt is not None else self.engine.config.cache_salt
        return list(chain_hashes(ids, self.engine.layout.block_size, (*self.engine.extra_keys, salt)))

    def _must_load(self, hashes: Sequence[str]) -> str | None:
        """Engine thread: the reason a hit starting at `hashes[0]` is loaded regardless of cost, or None."""
        with self._lock:
            named = bool(hashes) and self._expected[hashes[0]] > 0
        return "a prefill worker stored these blocks for this decode (kv_transfer_params)" if named else None

    @contextmanager
    def expecting(self, hashes: Sequence[str]) -> Iterator[None]:
        """While inside, an admission whose tier hit starts at one of `hashes` loads it."""
        with self._lock:
            self._expected.update(hashes)
        try:
            yield
        finally:
            with self._lock:
                self._expected.subtract(hashes)
                self._expected += Counter()  # drop the zero counts

    def _leading_in_redis(self, hashes: Sequence[str]) -> int:
        """How many leading `hashes` the Redis tier holds, in its codec or its fallback codec (two round trips)."""
        tier, j = self.connector.store.tiers[self.tier], self.tier
        found = tier.contains_many([self.connector.key(h, j) for h in hashes])
        alt = [self.connector._fallback_key(j, h) for h in hashes]
        if not all(found) and all(k is not None for k in alt):
            found = [a or b for a, b in zip(found, tier.contains_many([k for k in alt if k is not None]),
                                            strict=True)]
        return next((i for i, hit in enumerate(found) if not hit), len(hashes))

    def _stored(self, hashes: Sequence[str]) -> tuple[int, bool]:
        """Worker thread: wait until this prompt's blocks are in Redis, or the write queue has nothing left that
        could bring them; how many leading `hashes` Redis holds, and whether that was settled in time. Only this
        request's blocks are waited for (the queue is polled, not drained), except under write-back, where the
        blocks sit in RAM until a flush writes every dirty entry down."""
        store = self.connector.store
        if store.write_back:
            flushed = self.connector.flush(FLUSH_TIMEOUT_S)
            return self._leading_in_redis(hashes), bool(flushed)
        deadline, delay = time.monotonic() + FLUSH_TIMEOUT_S, 0.002
        while True:
            n = self._leading_in_redis(hashes)
            if n == len(hashes):
                return n, True
            if store.flush(0.0):  # nothing pending: no write still to come can add a block
                return self._leading_in_redis(hashes), True
            if time.monotonic() >= deadline:
                return n, False
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    async def prefilled(self, ids: Sequence[int], cache_salt: str | None) -> dict[str, Any]:
        """The prefill response's kv_transfer_params: the leading full blocks of the prompt now in Redis."""
        hashes = self.prompt_hashes(ids, cache_salt)
        n, flushed = await asyncio.to_thread(self._stored, hashes)
        out: dict[str, Any] = {"do_remote_decode": False, "do_remote_prefill": True,
                               "remote_engine_id": self.engine_id, "remote_block_ids": None, "remote_host": None,
                               "remote_port": None, "hafiza_blocks": n,
                               "hafiza_hashes_tail": hashes[n - 1] if n else None, "hafiza_prompt_blocks": len(hashes)}
        if n < len(hashes):
            why = f"not written within {FLUSH_TIMEOUT_S:g} s" if not flushed else "saves were dropped or expired"
            out["hafiza_note"] = f"only {n} of the prompt's {len(hashes)} full blocks are in Redis ({why})"
        return out

    @contextmanager
    def decoding(self, transfer: Transfer | None, ids: Sequence[int], cache_salt: str | None
                 ) -> Iterator[DecodeCheck]:
        """Around a decode's admission: force the load of the named blocks when they match this prompt."""
        check = DecodeCheck(transfer, self.engine.layout.block_size, len(ids))
        if transfer is None or transfer.prefill or not transfer.blocks:
            yield check
            return
        hashes = self.prompt_hashes(ids, cache_salt)
        if transfer.blocks > len(hashes) or hashes[transfer.blocks - 1] != transfer.tail:
            check.note = ("the stored blocks are not this prompt's (hafiza_hashes_tail differs: other tokens, "
                          "cache partition, model or KV format)")
            yield check
            return
        with self.expecting(hashes[: transfer.blocks]):
            yield check


@dataclass
class DecodeCheck:
    """What became of the blocks a decode was handed: loaded, found in the pool, or recomputed (and why)."""

    transfer: Transfer | None
    block_size: int
    prompt_tokens: int
    note: str = ""

    @property
    def active(self) -> bool:
        return self.transfer is not None and not self.transfer.prefill

    def result(self, first: RequestOutput) -> dict[str, Any]:
        """The decode response's kv_transfer_params: loaded, pool and recomputed counts of the named blocks."""
        assert self.transfer is not None
        usable = min(self.transfer.blocks, (self.prompt_tokens - 1) // self.block_size)
        t = first.tiers
        pool = min(usable, (t.pool_tokens if t else first.num_cached_tokens) // self.block_size)
        loaded = min(usable - pool, t.loaded_blocks if t else 0)
        recomputed = usable - pool - loaded
        note = self.note
        if recomputed and not note:
            note = f"{recomputed} of the {usable} stored blocks were recomputed: {t.reason if t else 'no tier outcome'}"
        return {"do_remote_decode": False, "do_remote_prefill": False, "remote_engine_id": self.transfer.engine_id,
                "hafiza_blocks": self.transfer.blocks, "hafiza_pool_blocks": pool, "hafiza_loaded_blocks": loaded,
                "hafiza_recomputed_blocks": recomputed, "hafiza_note": note or None}

    def header(self, result: dict[str, Any]) -> str:
        """The `remote=` part appended to x-hafiza-tiers."""
        state = "recomputed" if result["hafiza_recomputed_blocks"] else "loaded"
        return (f"remote={state} (named {result['hafiza_blocks']}, pool {result['hafiza_pool_blocks']}, loaded "
                f"{result['hafiza_loaded_blocks']}, recomputed {result['hafiza_recomputed_blocks']} blocks)")


class Handoff:
    """One request's part in the split, around its generation: force the decode's load during admission, then
    the response's kv_transfer_params and the `remote=` part of x-hafiza-tiers. A no-op without a transfer."""

    def __init__(self, pd: PDWorker | None, transfer: Transfer | None, ids: Sequence[int],
                 cache_salt: str | None) -> None:
        self.pd, self.transfer, self.ids, self.cache_salt = pd, transfer, list(ids), cache_salt
        self.check: DecodeCheck | None = None
        self.result: dict[str, Any] | None = None

    @classmethod
    def of(cls, pd: PDWorker | None, value: object, stream: bool, prompts: Sequence[Sequence[int]],
           cache_salt: str | None) -> Handoff:
        """The handoff a request's kv_transfer_params ask for (400 naming the field when it cannot be done)."""
        transfer = parse_transfer(value, pd.role if pd is not None else "both", stream, len(prompts))
        return cls(pd if transfer is not None else None, transfer, prompts[0] if prompts else (), cache_salt)

    @contextmanager
    def admission(self) -> Iterator[None]:
        """Wrap the generation's start: a decode's named blocks are loaded, not recomputed."""
        if self.pd is None or self.transfer is None or self.transfer.prefill:
            yield
            return
        with self.pd.decoding(self.transfer, self.ids, self.cache_salt) as check:
            self.check = check
            yield

    async def finish(self, first: RequestOutput) -> dict[str, Any] | None:
        """After the prompt is computed (a prefill: after the whole answer): the response's kv_transfer_params."""
        if self.pd is None or self.transfer is None:
            return None
        if self.transfer.prefill:
            self.result = await self.pd.prefilled(self.ids, self.cache_salt)
        elif self.check is not None:
            self.result = self.check.result(first)
        return self.result

    def headers(self, headers: dict[str, str], tiers_header: str) -> dict[str, str]:
        """`headers` with the decode's `remote=` part added to x-hafiza-tiers."""
        if self.check is None or self.result is None or tiers_header not in headers:
            return headers
        return {**headers, tiers_header: f"{headers[tiers_header]}; {self.check.header(self.result)}"}
