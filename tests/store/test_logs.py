"""The store's rate-limited log: one line per key per interval, the next line counts what was folded."""

from __future__ import annotations

import logging

import pytest

from hafiza.store.logs import RateLimitedLog


class _Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_repeats_within_the_interval_are_folded_into_the_next_line(caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock()
    limited = RateLimitedLog(logging.getLogger("hafiza.store.test"), interval_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="hafiza.store.test"):
        written = [limited.warning("set", "SET refused: %s", i) for i in range(716)]
        assert written.count(True) == 1 and limited.suppressed("set") == 715
        clock.now += 9.99
        assert limited.warning("set", "SET refused: %s", "late") is False
        clock.now += 0.01
        assert limited.warning("set", "SET refused: %s", "next") is True
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["SET refused: 0", "SET refused: next (716 similar lines suppressed in the last 10 s)"]
    assert limited.suppressed("set") == 0


def test_keys_are_limited_separately_and_levels_are_kept(caplog: pytest.LogCaptureFixture) -> None:
    limited = RateLimitedLog(logging.getLogger("hafiza.store.test"), interval_s=10.0, clock=_Clock())
    with caplog.at_level(logging.WARNING, logger="hafiza.store.test"):
        assert limited.warning("a", "first a") and limited.error("b", "first b")
        assert not limited.warning("a", "second a") and not limited.error("b", "second b")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "first a"),
        (logging.ERROR, "first b"),
    ]
