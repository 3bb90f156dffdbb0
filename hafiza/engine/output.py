"""Per-request output: incremental detokenisation, stop strings held back until they cannot match, and token
log-probabilities from the model's own distribution."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hafiza.models.tokenizer import IncrementalDecoder, Tokenizer


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model, and the `k` most likely tokens at that position (id, logprob),
    most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """For each row of raw logits [R, V] (any float dtype, computed in fp32) the logprob of `token_ids[r]` and the
    top `k`: log_softmax of the model's logits before any penalty, bias, grammar or temperature."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(token_ids, dtype=torch.long, device=logp.device)[:, None])[:, 0].tolist()
    if k > 0:
        values, ids = torch.topk(logp, k, dim=-1)
        tops = [list(zip(r_ids, r_vals, strict=True)) for r_ids, r_vals in zip(ids.tolist(), values.tolist(),
                                                                                  strict=True)]
    else:
        tops = [[] for _ in token_ids]
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(token_ids, chosen, tops, strict=True)]


class TextOutput:
    """Accumulates decoded text; `add` returns the text that is safe to emit and whether a stop string hit.
    `skip_special`: control tokens are left out of the text. `keep_stop`: a matched stop string stays at the end
    of the text (it is cut off otherwise)."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str], skip_special: bool = True,
                 keep_stop: bool = False) -> None:
        self.decoder = IncrementalDecoder(tokenizer) if skip_special else _KeepSpecialDecoder(tokenizer)
        self.stop = stop
        self.keep_stop = keep_stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stop_sequence: str | None = None

    def add(self, token_id: int, check_stop: bool = True) -> str:
        """Decode one more token. With `check_stop` false (before min_tokens) stop strings are not looked for and
        nothing is held back, so a stop string that ends there never matches later (vLLM's min_tokens)."""
        self.text += self.decoder.add(token_id)
        if not check_stop:
            return self._emit(len(self.text))
        if self.stop:
            search_from = max(0, self.emitted - self.hold)
            hits = [(self.text.find(s, search_from), s) for s in self.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                self.stop_sequence, self.text = s, self.text[: i + len(s) if self.keep_stop else i]
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


class _KeepSpecialDecoder(IncrementalDecoder):
    """IncrementalDecoder with control tokens kept in the text (skip_special_tokens false)."""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        full = self.tokenizer.decode(self.ids, skip_special=False)
        if full.endswith("\ufffd"):
            return ""
        delta = full[len(self.text) :]
        self.text = full
        return delta
