"""AsyncEngine: the engine on its own thread, fed by asyncio coroutines (the HTTP server's way in)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from hafiza.engine.engine import EngineStats, LLMEngine, RequestOutput
from hafiza.engine.sampling import SamplingParams
from hafiza.engine.sequence import CachePin

log = logging.getLogger("hafiza.engine")


class EngineDeadError(RuntimeError):
    """The engine thread failed while running a request (a bug, reported to that request's caller)."""


class AsyncEngine:
    """Owns the engine thread. Only that thread touches the LLMEngine; everything else goes through commands."""

    def __init__(self, engine: LLMEngine, stats_interval_s: float = 0.2) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._stats = engine.stats()
        self._stats_interval = stats_interval_s
        self._thread = threading.Thread(target=self._run, name="hafiza-engine", daemon=True)
        self.step_listeners: list[Callable[[list[RequestOutput]], None]] = []

    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        """Whether the engine thread is running."""
        return self._thread.is_alive()

    def stats(self) -> EngineStats:
        """The latest snapshot, taken on the engine thread (at most `stats_interval_s` old)."""
        return self._stats

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       cache_salt: str | None = None, pins: Sequence[CachePin] = ()) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Raises RequestError before the first output if it can never be served;
        if the consumer stops early (client disconnect), the request is aborted and its blocks freed."""
        self.engine.check_request(prompt_ids, params)
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (loop, q)
        self._send("add", (rid, prompt_ids, params, cache_salt, tuple(pins)))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    break
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self._send("abort", rid)

    def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between steps (dashboard actions, consistent reads)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._send("call", (fn, fut))
        return await asyncio.wrap_future(fut)

    def _send(self, kind: str, payload: Any) -> None:
        self._commands.put((kind, payload))
        self._wake.set()

    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(rid)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                rid, ids, params, salt, pins = payload
                if rid not in self._streams:
                    continue  # the caller went away before the request started
                try:
                    self.engine.add_request(ids, params, request_id=rid, cache_salt=salt, pins=pins)
                except Exception as exc:  # RequestError races (e.g. duplicate id) go back to the caller
                    self._deliver(rid, exc)
            elif kind == "abort":
                self.engine.abort(payload)
            elif kind == "call":
                fn, fut = payload
                try:
                    fut.set_result(fn(self.engine))
                except Exception as exc:
                    fut.set_exception(exc)

    def _run(self) -> None:
        last_stats = 0.0
        while not self._stop.is_set():
            self._drain_commands()
            if self.engine.has_unfinished():
                try:
                    outputs = self.engine.step()
                except Exception as exc:
                    log.exception("engine step failed; failing the running requests")
                    self._fail_all(exc)
                    continue
                for listener in self.step_listeners:  # before delivery, so what they record is there first
                    try:
                        listener(outputs)
                    except Exception:  # a monitoring hook must never stop the engine
                        log.exception("step listener %r failed", listener)
                for out in outputs:
                    self._deliver(out.request_id, out)
            else:
                self._wake.wait(0.05)
                self._wake.clear()
            now = time.monotonic()
            if now - last_stats >= self._stats_interval or not self.engine.has_unfinished():
                self._stats, last_stats = self.engine.stats(), now

    def _fail_all(self, exc: Exception) -> None:
        for rid in list(self.engine.seqs):
            self.engine.abort(rid)
            self._deliver(rid, EngineDeadError(f"engine step failed: {exc}"))
