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
from typing import TypeVar, cast

from hafiza.engine.commands import AbortRequest, AddRequest, Command, EngineCall
from hafiza.engine.engine import LLMEngine
from hafiza.engine.results import EngineStats, RequestOutput
from hafiza.engine.sampling import SamplingParams
from hafiza.engine.sequence import CachePin, Status
from hafiza.errors import RequestError

log = logging.getLogger("hafiza.engine")
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine failed while running a request (a bug, reported to that request's caller). A failure that
    belongs to one request (its forward or sampling) reaches that request alone; only a failure of the step
    itself (scheduling, bookkeeping) fails every request in the engine."""


class EngineOverloadedError(RuntimeError):
    """The request was refused before it ran: the waiting queue was full, or it waited past the queue-time
    limit. `retry_after_s` is a hint for the client."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class AsyncEngine:
    """Owns the engine thread. Once `start()`ed, only that thread touches the LLMEngine: everything else goes
    through commands, except `check_request`, which reads only what is fixed at construction. Attach the
    connector and the listeners before `start()`.

    The path of a request: `submit` checks it (once) and queues an "add" command; the engine thread takes it
    (`add_checked`), steps, and puts each output straight into the request's `RequestStream` queue, the only
    queue between the engine thread and the caller.

    Overload has a shape: with `max_waiting`, a request arriving while that many wait for admission is refused
    at once; with `max_queue_time_s`, a request not admitted within that time is taken out of the queue. Both
    reach the caller as EngineOverloadedError. `admission_listeners` get each request's queue time in seconds
    (arrival to its first scheduled step) on the engine thread."""

    def __init__(self, engine: LLMEngine, stats_interval_s: float = 0.2, max_waiting: int | None = None,
                 max_queue_time_s: float | None = None) -> None:
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        if max_queue_time_s is not None and not max_queue_time_s > 0:
            raise ValueError(f"max_queue_time_s must be > 0, got {max_queue_time_s}")
        self.engine = engine
        self.max_waiting, self.max_queue_time_s = max_waiting, max_queue_time_s
        self.admission_listeners: list[Callable[[float], None]] = []
        self._unadmitted: dict[str, float] = {}  # request id -> arrival time, in arrival order
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | BaseException]]] = {}
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
        """Stop the engine thread (a no-op if it never started)."""
        self._stop.set()
        self._wake.set()
        if self._thread.ident is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        """Whether the engine thread is running."""
        return self._thread.is_alive()

    @property
    def pending_commands(self) -> int:
        """Commands (new requests, aborts, calls) sent but not yet taken by the engine thread."""
        return self._commands.qsize()

    def stats(self) -> EngineStats:
        """The latest snapshot, taken on the engine thread (at most `stats_interval_s` old)."""
        return self._stats

    async def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                     cache_salt: str | None = None, pins: Sequence[CachePin] = ()) -> RequestStream:
        """Check the request once, here (RequestError if it can never be served: the engine thread does not
        check it again), and queue it; its outputs arrive on the returned stream. A grammar is compiled on a
        worker thread, so neither the event loop nor the engine thread waits for it."""
        if params.grammar is not None:
            await asyncio.to_thread(self.engine.check_request, prompt_ids, params)
        else:
            self.engine.check_request(prompt_ids, params)
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        stream = RequestStream(self, rid, params.n)
        self._streams[rid] = (asyncio.get_running_loop(), stream.queue)
        self._send(AddRequest(rid, list(prompt_ids), params, cache_salt, tuple(pins)))
        return stream

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       cache_salt: str | None = None, pins: Sequence[CachePin] = ()) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Raises RequestError before the first output if it can never be served;
        if the consumer stops early (client disconnect), the request is aborted and its blocks freed. With n > 1
        the n choices' outputs interleave (`index` tells them apart); the stream ends when all have finished."""
        stream = await self.submit(prompt_ids, params, request_id, cache_salt, pins)
        try:
            while not stream.finished:
                yield await stream.get()
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        self._send(AbortRequest(request_id))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps (dashboard actions, consistent reads)."""
        fut: concurrent.futures.Future[object] = concurrent.futures.Future()
        self._send(EngineCall(fn, fut))
        return cast(T, await asyncio.wrap_future(fut))

    def _send(self, command: Command) -> None:
        self._commands.put(command)
        self._wake.set()

    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(rid)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, AddRequest):
                self._add(command)
            elif isinstance(command, AbortRequest):
                self.engine.abort(command.request_id)
            else:
                try:
                    command.future.set_result(command.fn(self.engine))
                except Exception as exc:
                    command.future.set_exception(exc)

    def _add(self, command: AddRequest) -> None:
        """Queue a checked request, unless its caller went away or the waiting queue is full."""
        rid = command.request_id
        if rid not in self._streams:
            return  # the caller went away before the request started
        waiting = self.engine.num_waiting
        if self.max_waiting is not None and waiting >= self.max_waiting:
            oldest = min(self._unadmitted.values(), default=time.monotonic())
            self._deliver(rid, EngineOverloadedError(
                f"server overloaded: {waiting} requests already wait for admission, the limit is "
                f"{self.max_waiting}", time.monotonic() - oldest))
            return
        try:
            self.engine.add_checked(command.prompt_ids, command.params, rid, command.cache_salt, command.pins)
        except Exception as exc:  # a race (an id already in use) goes back to the caller
            self._deliver(rid, exc)
            return
        seq = self.engine.request(rid)
        self._unadmitted[rid] = seq.arrival_time if seq is not None else time.monotonic()

    def _run(self) -> None:
        last_stats = 0.0
        while not self._stop.is_set():
            self._drain_commands()
            self._expire_queued()
            if self.engine.has_unfinished():
                step_start = time.monotonic()
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
                self._note_admissions(step_start)
                if any(out.finished or out.num_output_tokens <= 1 for out in outputs):
                    self._stats = self.engine.stats()  # /metrics agrees with every response already delivered
                for out in outputs:
                    failure = EngineDeadError(f"request failed: {out.error}") if out.error is not None else None
                    self._deliver(out.request_id, failure or out)
            else:
                self._wake.wait(0.05)
                self._wake.clear()
            now = time.monotonic()
            if now - last_stats >= self._stats_interval or not self.engine.has_unfinished():
                self._stats, last_stats = self.engine.stats(), now

    def _expire_queued(self) -> None:
        """Take out of the queue every request that has waited past `max_queue_time_s` without being admitted."""
        if self.max_queue_time_s is None or not self._unadmitted:
            return
        now = time.monotonic()
        for rid, arrival in list(self._unadmitted.items()):
            if now - arrival <= self.max_queue_time_s:
                break  # arrival order: the rest waited less
            del self._unadmitted[rid]
            seq = self.engine.request(rid)
            if seq is None or seq.num_computed > 0:
                continue
            self.engine.abort(rid)
            self._deliver(rid, EngineOverloadedError(
                f"server overloaded: the request waited {now - arrival:.1f} s without being scheduled, the limit "
                f"is {self.max_queue_time_s:g} s", self.max_queue_time_s))

    def _note_admissions(self, step_start: float) -> None:
        """Report the queue time of requests the last step admitted (admission is in arrival order)."""
        for rid, arrival in list(self._unadmitted.items()):
            seq = self.engine.request(rid)
            if seq is not None and seq.status is Status.WAITING and seq.num_computed == 0:
                break
            del self._unadmitted[rid]
            if seq is None and rid not in self._streams:
                continue  # aborted while waiting
            for listener in self.admission_listeners:
                try:
                    listener(max(0.0, step_start - arrival))
                except Exception:  # a monitoring hook must never stop the engine
                    log.exception("admission listener %r failed", listener)

    def _fail_all(self, exc: Exception) -> None:
        for rid in self.engine.request_ids():
            self.engine.abort(rid)
            self._deliver(rid, EngineDeadError(f"engine step failed: {exc}"))


class RequestStream:
    """One request's outputs: the engine thread puts each straight into `queue` (the only queue between the
    engine and the caller), and `get` hands them out. Always `close()` it: a request not finished by then is
    aborted and its blocks freed. With n > 1 choices the stream is finished once all n have finished."""

    def __init__(self, aengine: AsyncEngine, request_id: str, n: int) -> None:
        self.aengine, self.request_id = aengine, request_id
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False
        self._unfinished = n
        self._added = True

    async def get(self) -> RequestOutput:
        """The next output. The engine's error for this request (EngineDeadError, EngineOverloadedError, or a
        RequestError when the id was already in use) is raised instead, and ends the stream."""
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            self._added = not isinstance(item, RequestError)  # never added: the id belongs to another request
            raise item
        self._unfinished -= item.finished
        self.finished = self._unfinished == 0
        return item

    def close(self) -> None:
        """Stop delivering, and abort the request if any of its choices is still unfinished."""
        if self.aengine._streams.pop(self.request_id, None) is not None and self._unfinished and self._added:
            self.aengine.abort(self.request_id)
