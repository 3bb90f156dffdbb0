"""ServingGate: keeps the store's background encodes off the serving path.

The engine thread says when it is serving (`serving(True)` before a forward, `serving(False)` once nothing is
left to run); the store's writer calls `wait_idle()` before each slice of costly encode work (a predictor chunk)
and brackets it with `encoding()`. An encode therefore never starts while a request is being prefilled or
decoded; one already running finishes its current slice. Each side can ask whether the other was active during
its own measurement (`overlapped`), so the cost model keeps speeds measured without competition.

With a HostGate the state is host-wide: serving also holds the host's shared lock, and a writer also waits while
any other hafiza instance on the host serves (instances sharing cores would otherwise slow each other's requests).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from hafiza.store.host_gate import HostGate

Event = Callable[[str], None]


@dataclass(frozen=True)
class GateMark:
    """The gate's state at one instant; two marks tell whether a side was active between them (`overlapped`)."""

    serve_epoch: int  # how many times this process started serving
    encode_epoch: int  # how many encode slices this process started
    busy: bool
    encoding: bool
    host_epoch: int = 0  # the host-wide serving epoch (0 without a host gate)
    host_busy: bool = False  # some instance on the host was serving


class ServingGate:
    """Engine busy/idle state, and the writer's wait for idle; thread-safe. `on_event(name)` hears every
    transition (`serve`, `idle`, `encode`, `encoded`), in order, for tests and tracing."""

    def __init__(self, on_event: Event | None = None, idle_check: Callable[[], bool] | None = None,
                 recheck_s: float = 0.05, host: HostGate | None = None) -> None:
        """`idle_check()` (e.g. the engine has nothing unfinished) lets a waiting writer go on when the engine
        stopped without a last `serving(False)` (a request aborted between steps); it is asked every
        `recheck_s` while the writer waits. `host` makes the gate host-wide; other instances stop serving
        without notifying this process, so a waiting writer then also looks again every `recheck_s`."""
        self._cond = threading.Condition()
        self.idle_check, self.recheck_s, self.host = idle_check, recheck_s, host
        self._busy = False
        self._encoding = 0
        self._busy_epoch = 0  # how many times serving started
        self._encode_epoch = 0  # how many encode slices started
        self._closed = False
        self.on_event = on_event
        self.waits = 0  # encode slices that had to wait for the engine to go idle

    def _emit(self, name: str) -> None:
        if self.on_event is not None:
            self.on_event(name)

    def serving(self, busy: bool) -> None:
        """Engine thread: a forward is about to run (True), or nothing is left to run (False)."""
        with self._cond:
            if busy == self._busy:
                return
            self._busy = busy
            if busy:
                self._busy_epoch += 1
                if self.host is not None:
                    self.host.hold()
            elif self.host is not None:
                self.host.release()
            self._emit("serve" if busy else "idle")
            self._cond.notify_all()

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._busy

    def _held(self) -> bool:
        """Whether a writer must wait now (called under the condition's lock)."""
        if self._closed:
            return False
        if self._busy and self.idle_check is not None and self.idle_check():
            self._busy = False
            if self.host is not None:
                self.host.release()
            self._emit("idle")
        if self._busy:
            return True
        return self.host is not None and self.host.busy()

    def _wait(self) -> None:
        """Block until the engine, and every other instance on the host, is idle (under the condition's lock)."""
        if self._held():
            self.waits += 1
        polled = self.idle_check is not None or self.host is not None
        while self._held():
            self._cond.wait(self.recheck_s if polled else None)

    def wait_idle(self) -> None:
        """Writer thread: block until the engine is idle (or the gate is closed)."""
        with self._cond:
            self._wait()

    @contextmanager
    def encoding(self) -> Iterator[None]:
        """Writer thread: one slice of encode work, started only while the engine is idle."""
        with self._cond:
            self._wait()
            self._encoding += 1
            self._encode_epoch += 1
            self._emit("encode")
        try:
            yield
        finally:
            with self._cond:
                self._encoding -= 1
                self._emit("encoded")
                self._cond.notify_all()

    def marks(self) -> GateMark:
        """The state now: compare two marks with `overlapped`."""
        with self._cond:
            host = self.host
            return GateMark(self._busy_epoch, self._encode_epoch, self._busy, self._encoding > 0,
                            host.epoch() if host is not None else 0, host is not None and host.busy())

    @staticmethod
    def overlapped(before: GateMark, after: GateMark, other: str) -> bool:
        """Whether `other` ("serve": this process's or, with a host gate, any instance's; "encode": this
        process's) was active at any point between two marks."""
        if other == "serve":
            return (before.busy or after.busy or after.serve_epoch != before.serve_epoch
                    or before.host_busy or after.host_busy or after.host_epoch != before.host_epoch)
        return before.encoding or after.encoding or after.encode_epoch != before.encode_epoch

    def close(self) -> None:
        """Release any waiting writer for good (shutdown: pending encodes run to completion)."""
        with self._cond:
            self._closed = True
            if self.host is not None:
                self.host.close()
            self._cond.notify_all()
