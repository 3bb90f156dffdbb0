"""Per-request text output: incremental detokenisation, stop strings held back until they cannot match."""

from __future__ import annotations

from hafiza.models.tokenizer import IncrementalDecoder, Tokenizer


class TextOutput:
    """Accumulates decoded text; `add` returns the text that is safe to emit and whether a stop string hit."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self.decoder = IncrementalDecoder(tokenizer)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stop_sequence: str | None = None

    def add(self, token_id: int) -> str:
        self.text += self.decoder.add(token_id)
        if self.stop:
            search_from = max(0, self.emitted - self.hold)
            hits = [(self.text.find(s, search_from), s) for s in self.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                self.stop_sequence, self.text = s, self.text[:i]
                return self._emit(len(self.text))
        return self._emit(len(self.text) - self.hold)

    def flush(self) -> str:
        """Everything not yet emitted (at the end of generation)."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        delta = self.text[self.emitted : upto]
        self.emitted = upto
        return delta
