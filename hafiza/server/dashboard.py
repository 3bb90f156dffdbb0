"""GET /dashboard: a live page of the KV cache (charts, largest cached prefixes, tiers) and its actions.

The page and its script ship in `hafiza/server/static/` (no CDN). It polls `GET /dashboard/state` every second;
that JSON is taken on the engine thread (`AsyncEngine.call`), so block counts, prefixes and rates agree with each
other. Actions: `POST /dashboard/prefixes/{id}/drop` evicts one cached prefix, `POST /dashboard/tiers/{name}/clear`
empties a store tier (or `pool`: every cached block of the KV pool not held by a request). Keys are sent like
the API's (`x-api-key` or `Authorization: Bearer`). The state is readable as `dashboard_auth` says (any API
key by default), but the text of cached prompts is in it only for the admin key; the actions need the admin key
(an open server, with no key at all, lets everyone act).
"""

from __future__ import annotations

import asyncio
import importlib.resources
import statistics
import time
import weakref
from collections import deque
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from hafiza.engine.async_engine import AsyncEngine
from hafiza.engine.engine import LLMEngine
from hafiza.engine.results import RequestOutput
from hafiza.server.auth import Role, caller, require_access, require_admin
from hafiza.server.errors import ApiError
from hafiza.server.prefixes import PrefixIndex
from hafiza.server.state import server_state
from hafiza.store.connector import StoreConnector
from hafiza.store.tiered import TieredStore

ENGINE_CALL_TIMEOUT_S = 10.0
STATIC_TYPES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
POOL = "pool"

router = APIRouter()


class LiveRates:
    """Recent TTFTs and generated tokens, recorded from step outputs on the engine thread."""

    def __init__(self, token_window_s: float = 3.0, ttft_window_s: float = 30.0) -> None:
        self.token_window_s, self.ttft_window_s = token_window_s, ttft_window_s
        self.tokens: deque[tuple[float, int]] = deque()
        self.ttfts: deque[tuple[float, float]] = deque(maxlen=512)

    def observe(self, outputs: list[RequestOutput]) -> None:
        """Step listener: count new tokens; note the TTFT of each request's first token."""
        now = time.monotonic()
        n = sum(len(o.new_token_ids) for o in outputs)
        if n:
            self.tokens.append((now, n))
        for o in outputs:
            if o.new_token_ids and o.num_output_tokens == 1 and o.first_token_time is not None:
                self.ttfts.append((now, o.first_token_time - o.arrival_time))
        while self.tokens and self.tokens[0][0] < now - self.token_window_s:
            self.tokens.popleft()

    def snapshot(self) -> dict[str, float | None]:
        now = time.monotonic()
        recent_tokens = sum(n for t, n in self.tokens if t >= now - self.token_window_s)
        recent = [v for t, v in self.ttfts if t >= now - self.ttft_window_s]
        return {"tokens_per_s": recent_tokens / self.token_window_s,
                "ttft_recent_s": statistics.median(recent) if recent else None,
                "ttft_last_s": self.ttfts[-1][1] if self.ttfts else None}


class Monitor:
    """What the dashboard keeps per engine: the prefix index (read from the block manager) and the live rates (fed
    by a step listener)."""

    def __init__(self, aengine: AsyncEngine) -> None:
        self.engine = aengine.engine  # not the AsyncEngine: it keys the weak registry below
        self.prefixes = PrefixIndex(aengine.engine)
        self.rates = LiveRates()
        aengine.step_listeners.append(self.rates.observe)

    def engine_state(self, engine: LLMEngine, limit: int) -> dict[str, Any]:
        """Everything read from the engine, in one engine-thread call."""
        s = engine.stats()
        b = s.blocks
        return {
            "kv": {"usage": s.kv_cache_usage_perc, "dtype": s.kv_dtype, "block_size": b.block_size,
                   "bytes_per_block": s.bytes_per_block, "total_blocks": b.total,
                   "capacity_bytes": b.total * s.bytes_per_block, "stored_tokens": s.stored_tokens,
                   "waste_slots": s.waste_slots},
            "blocks": {"free": b.free, "cached": b.cached, "in_use": b.in_use, "pinned": b.pinned},
            "prefix_cache": {"queries": b.prefix_cache_queries, "hits": b.prefix_cache_hits,
                             "hit_rate": b.prefix_cache_hits / b.prefix_cache_queries if b.prefix_cache_queries
                             else None},
            "requests": {"running": s.num_running, "waiting": s.num_waiting, "finished": s.requests_finished},
            "counters": {"preemptions": s.num_preemptions, "evictions": b.evictions,
                         "pinned_evictions": b.pinned_evictions, "prompt_tokens": s.prompt_tokens,
                         "generation_tokens": s.generation_tokens},
            "speculative": None if s.spec is None else {
                "drafts": s.spec.num_drafts, "draft_tokens": s.spec.num_draft_tokens,
                "accepted_tokens": s.spec.num_accepted_tokens, "acceptance_rate": s.spec.acceptance_rate,
                "accepted_per_position": s.spec.accepted_per_position},
            "rates": self.rates.snapshot(),
            **self.prefixes.snapshot(limit),
        }



_monitors: weakref.WeakKeyDictionary[AsyncEngine, Monitor] = weakref.WeakKeyDictionary()


def monitor_for(aengine: AsyncEngine) -> Monitor:
    """One Monitor per engine, however many apps serve it."""
    if aengine not in _monitors:
        _monitors[aengine] = Monitor(aengine)
    return _monitors[aengine]


def tier_state(store: TieredStore | None) -> dict[str, Any]:
    """Per-tier bytes, entries, hit rates and compression, and the stack's totals (None without a store)."""
    if store is None:
        return {"tiers": [], "compression_ratio": None, "lookup_hit_rate": None}
    st = store.stats()
    tiers, raw, stored = [], 0, 0.0
    for rep in st.tiers:
        s = rep.stats
        gets = s.hits + s.misses
        tiers.append({"name": s.name, "kind": s.kind, "enabled": s.enabled, "degraded": s.degraded,
                      "entries": s.entries, "bytes": s.bytes, "capacity_bytes": s.capacity_bytes, "hits": s.hits,
                      "misses": s.misses, "hit_rate": s.hits / gets if gets else None, "puts": s.puts,
                      "errors": s.errors, "evictions": s.evictions, "lookup_hits": rep.lookup_hits,
                      "bytes_written": s.bytes_written, "raw_bytes_written": rep.raw_bytes_written,
                      "compression_ratio": rep.compression_ratio})
        if rep.compression_ratio:
            raw += rep.raw_bytes_written
            stored += rep.raw_bytes_written / rep.compression_ratio
    return {"tiers": tiers, "compression_ratio": raw / stored if stored else None,
            "lookups": st.lookups, "lookup_keys": st.lookup_keys, "lookup_hit_keys": st.lookup_hit_keys,
            "lookup_hit_rate": st.lookup_hit_keys / st.lookup_keys if st.lookup_keys else None,
            "write_queue": st.queue_depth, "writes_dropped": st.writes_dropped}


async def _on_engine(request: Request, fn: Any) -> Any:
    """Run `fn(engine)` on the engine thread; 503 if the engine does not answer."""
    try:
        return await asyncio.wait_for(server_state(request).aengine.call(fn), ENGINE_CALL_TIMEOUT_S)
    except TimeoutError as exc:
        raise ApiError(503, "the engine did not answer within "
                            f"{ENGINE_CALL_TIMEOUT_S:.0f} s", code="engine_unavailable") from exc


def _static(name: str) -> str:
    return importlib.resources.files("hafiza.server").joinpath("static", name).read_text(encoding="utf-8")


@router.get("/dashboard", include_in_schema=False)
async def dashboard_page() -> HTMLResponse:
    """The page (no key needed: it asks for one when the state answers 401)."""
    return HTMLResponse(_static("dashboard.html"), headers={"cache-control": "no-store"})


@router.get("/dashboard/static/{name}", include_in_schema=False)
async def dashboard_asset(name: str) -> Response:
    if name not in STATIC_TYPES:
        raise ApiError(404, f"no dashboard asset {name!r}", code="not_found")
    return Response(_static(name), media_type=STATIC_TYPES[name], headers={"cache-control": "no-store"})


@router.get("/dashboard/state", dependencies=[Depends(require_access(lambda s: s.dashboard_auth))])
async def dashboard_state(request: Request, limit: int = 20) -> JSONResponse:
    """One consistent snapshot: KV pool, blocks by state, prefix cache, requests, rates, prefixes, tiers. Unless
    the caller is admin, a prefix's `head` and `tail` (cached prompt text) and `id` (its leaf block hash, which
    would let anyone test guesses of a prompt offline) are null."""
    state = server_state(request)
    mon: Monitor = request.app.state.dashboard
    limit = max(1, min(limit, 200))
    engine = await _on_engine(request, lambda e: mon.engine_state(e, limit))
    admin = caller(request).role >= Role.ADMIN
    if not admin:
        for row in engine["prefixes"]:
            row["head"] = row["tail"] = row["id"] = None
    connector = state.store
    tiers = await asyncio.to_thread(tier_state, connector.store if connector else None)
    return JSONResponse({"time": time.time(), "model": state.settings.model_name,
                         "auth": not state.settings.is_open, "admin": admin, **engine, "store": tiers},
                        headers={"cache-control": "no-store"})


@router.post("/dashboard/prefixes/{prefix_id}/drop", dependencies=[Depends(require_admin)])
async def drop_prefix(request: Request, prefix_id: str, include_shared: bool = False,
                      tiers: bool = True) -> dict[str, Any]:
    """Evict a listed prefix's own cached blocks (with `include_shared`, also those other prefixes share) from the
    pool and, unless `tiers=false`, from every store tier (else the next request would load them back)."""
    mon: Monitor = request.app.state.dashboard
    try:
        report, hashes = await _on_engine(request, lambda e: mon.prefixes.drop(prefix_id, include_shared))
    except KeyError as exc:
        raise ApiError(404, f"no cached prefix {prefix_id!r} (already evicted?)", code="not_found") from exc
    connector = server_state(request).store
    if tiers and connector is not None:
        report["deleted_from_tiers"] = await asyncio.to_thread(delete_from_tiers, connector, hashes)
    return report


def delete_from_tiers(connector: StoreConnector, hashes: list[str]) -> dict[str, int]:
    """Delete blocks from every tier of the connector's store, once its pending writes have landed."""
    connector.flush(5.0)
    return {tier.name: sum(tier.delete(connector.key(h, j)) for h in hashes)
            for j, tier in enumerate(connector.store.tiers)}


@router.post("/dashboard/tiers/{name}/clear", dependencies=[Depends(require_admin)])
async def clear_tier(request: Request, name: str) -> dict[str, Any]:
    """Empty one store tier, or with `pool` evict every cached block of the KV pool that no request holds."""
    if name == POOL:
        def drop_all(engine: LLMEngine) -> int:
            return engine.blocks.drop(list(engine.blocks.hash_to_block))

        return {"tier": POOL, "dropped_blocks": await _on_engine(request, drop_all)}
    connector = server_state(request).store
    store = connector.store if connector else None
    tier = next((t for t in (store.tiers if store else []) if t.name == name), None)
    if tier is None:
        names = [POOL, *(store.names if store else [])]
        raise ApiError(404, f"no tier {name!r}: this server has {', '.join(names)}", code="not_found")
    before = (await asyncio.to_thread(tier.stats)).entries
    await asyncio.to_thread(tier.clear)
    return {"tier": name, "entries_before": before, "entries_after": (await asyncio.to_thread(tier.stats)).entries}


def mount_dashboard(app: FastAPI) -> None:
    """Add the dashboard routes and start watching the app's engine (called by `create_app`)."""
    app.state.dashboard = monitor_for(app.state.hafiza.aengine)
    app.include_router(router)
