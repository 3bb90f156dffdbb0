"""ServingGate: keeps the store's background encodes off the serving path.

The engine thread says when it is serving (`serving(True)` before a forward, `serving(False)` once nothing is
left to run); the store's writer calls `wait_idle()` before each slice of costly encode work (a predictor chunk)
and brackets it with `encoding()`. An encode therefore never starts while a request is being prefilled or
decoded; one already running finishes its current slice. Each side can ask whether the other was active during
its own measurement (`overlapped`), so the cost model keeps speeds measured without competition.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Event = Callable[[str], None]


class ServingGate:
    """Engine busy/idle state, and the writer's wait for idle; thread-safe. `on_event(name)` hears every
    transition (`serve`, `idle`, `encode`, `encoded`), in order, for tests and tracing."""

    def __init__(self, on_event: Event | None = None, idle_check: Callable[[], bool] | None = None,
                 recheck_s: float = 0.05) -> None:
        """`idle_check()` (e.g. the engine has nothing unfinished) lets a waiting writer go on when the engine
        stopped without a last `serving(False)` (a request aborted between steps); it is asked every
        `recheck_s` while the writer waits."""
        self._cond = threading.Condition()
        self.idle_check, self.recheck_s = idle_check, recheck_s
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
            self._emit("serve" if busy else "idle")
            self._cond.notify_all()

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._busy

    def _held(self) -> bool:
        """Whether a writer must wait now (called under the condition's lock)."""
        if not self._busy or self._closed:
            return False
        if self.idle_check is not None and self.idle_check():
            self._busy = False
            self._emit("idle")
            return False
        return True

    def _wait(self) -> None:
        """Block until the engine is idle (under the condition's lock)."""
        if self._held():
            self.waits += 1
        while self._held():
            self._cond.wait(self.recheck_s if self.idle_check is not None else None)

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

    def marks(self) -> tuple[int, int, bool, bool]:
        """(serving epoch, encode epoch, busy now, encoding now): compare two marks with `overlapped`."""
        with self._cond:
            return self._busy_epoch, self._encode_epoch, self._busy, self._encoding > 0

    @staticmethod
    def overlapped(before: tuple[int, int, bool, bool], after: tuple[int, int, bool, bool], other: str) -> bool:
        """Whether `other` ("serve" or "encode") was active at any point between two marks."""
        if other == "serve":
            return before[2] or after[2] or after[0] != before[0]
        return before[3] or after[3] or after[1] != before[1]

    def close(self) -> None:
        """Release any waiting writer for good (shutdown: pending encodes run to completion)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
