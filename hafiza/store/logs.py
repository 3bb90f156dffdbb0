"""Rate-limited log lines for the store: a fault that repeats (a refused SET, a flapping server) logs once.

Every store module logs through `store_log`: at most one line per key per `interval_s`. The next line of that
key that gets through says how many were suppressed in between, so nothing is hidden, only folded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

DEFAULT_INTERVAL_S = 10.0


class RateLimitedLog:
    """A logger wrapper that lets one line per key through every `interval_s` and counts the rest."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self._lock = threading.Lock()
        self._next: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def log(self, level: int, key: str, msg: str, *args: object, exc_info: bool = False) -> bool:
        """Log `msg % args` unless `key` logged less than `interval_s` ago; True when the line was written."""
        now = self.clock()
        with self._lock:
            if now < self._next.get(key, float("-inf")):
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return False
            self._next[key] = now + self.interval_s
            folded = self._suppressed.pop(key, 0)
        if folded:
            msg += " (%d similar lines suppressed in the last %.0f s)"
            args = (*args, folded, self.interval_s)
        self.logger.log(level, msg, *args, exc_info=exc_info)
        return True

    def warning(self, key: str, msg: str, *args: object, exc_info: bool = False) -> bool:
        """`log` at WARNING."""
        return self.log(logging.WARNING, key, msg, *args, exc_info=exc_info)

    def error(self, key: str, msg: str, *args: object, exc_info: bool = False) -> bool:
        """`log` at ERROR."""
        return self.log(logging.ERROR, key, msg, *args, exc_info=exc_info)

    def suppressed(self, key: str) -> int:
        """How many lines of `key` are being held back since the last one written."""
        with self._lock:
            return self._suppressed.get(key, 0)


store_log = RateLimitedLog(logging.getLogger("hafiza.store"))
