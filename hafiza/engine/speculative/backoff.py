"""Adaptive draft length: a sequence whose drafts keep being rejected drafts fewer tokens, then pauses drafting."""

from __future__ import annotations

from dataclasses import dataclass

MAX_PAUSE = 64  # the longest pause, in decode steps, after repeated fully rejected drafts


@dataclass
class DraftBudget:
    """How many tokens one sequence may draft next. A fully accepted draft of k tokens allows 2k next (up to the
    full length), so a short lucky draft does not buy a long wasted one; a partly accepted one drafts one more
    than was accepted; a fully rejected one halves the length, and at zero the sequence pauses (its rows would
    be wasted), for a pause that doubles each time it ends in another rejection."""

    max_tokens: int
    length: int = -1
    pause: int = 0
    next_pause: int = 1

    def __post_init__(self) -> None:
        if self.length < 0:
            self.length = self.max_tokens

    def allowed(self) -> int:
        """Tokens this decode step may draft (0 while paused; each call in a pause counts one step of it)."""
        if self.pause > 0:
            self.pause -= 1
            return 0
        return self.length

    def record(self, drafted: int, accepted: int) -> None:
        """Adapt to the outcome of one verified draft."""
        if drafted <= 0:
            return
        if accepted >= drafted:
            self.length, self.next_pause = min(self.max_tokens, 2 * drafted), 1
        elif accepted > 0:
            self.length, self.next_pause = min(self.max_tokens, accepted + 1), 1
        elif self.length > 1:
            self.length //= 2
        else:
            self.pause, self.next_pause = self.next_pause, min(MAX_PAUSE, self.next_pause * 2)
