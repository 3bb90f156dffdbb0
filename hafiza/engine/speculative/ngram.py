"""Prompt-lookup drafting: continue the request's latest n-gram by what followed its last earlier occurrence."""

from __future__ import annotations

from array import array

WIDTH = array("i").itemsize  # token ids are packed as 32-bit ints so a byte search finds n-grams


class NgramProposer:
    """Drafts from a request's own prompt and output; no model is involved. Longer n-grams are tried first (more
    context, likelier continuations); for each length the most recent earlier occurrence wins."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the last earlier occurrence of the longest matching suffix n-gram of
        `tokens` ([] when none of min_n..max_n tokens occurred before)."""
        total = len(tokens)
        if limit <= 0 or total <= self.min_n:
            return []
        data = array("i", tokens).tobytes()
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            start = self._last_occurrence(data, data[(total - n) * WIDTH :], (total - 1) * WIDTH)
            if start is not None:
                follow = start + n
                return tokens[follow : follow + limit]
        return []

    @staticmethod
    def _last_occurrence(data: bytes, pattern: bytes, end: int) -> int | None:
        """Token index of the last token-aligned occurrence of `pattern` lying wholly in data[:end]."""
        while True:
            at = data.rfind(pattern, 0, end)
            if at < 0:
                return None
            if at % WIDTH == 0:
                return at // WIDTH
            end = at + len(pattern) - 1
