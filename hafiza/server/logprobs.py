"""Log-probabilities in the OpenAI shapes: chat (`content` entries with bytes and top alternatives) and legacy
completions (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).

The numbers come from the engine (log-softmax of the model's raw logits, before any sampling transform); this
module only names the tokens: each token's exact bytes (byte-level BPE and SentencePiece byte tokens mapped back
to bytes), shown as UTF-8 text with invalid sequences replaced.
"""

from __future__ import annotations

import math
import re
from functools import lru_cache

from hafiza.engine.output import TokenLogprob
from hafiza.models.tokenizer import Tokenizer

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's reversible byte-to-character table, inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TokenNames:
    """Bytes and display text of token ids (cached per id)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, bytes] = {}
        self._special = set(tokenizer.backend.get_added_tokens_decoder())

    def bytes(self, token_id: int) -> bytes:
        if token_id not in self._cache:
            self._cache[token_id] = self._bytes(token_id)
        return self._cache[token_id]

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._special:
            return piece.encode()
        m = _BYTE_TOKEN.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        table = _byte_decoder()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return piece.replace("▁", " ").encode()

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")


def _finite(x: float) -> float:
    """JSON has no -inf: a token the model gives no probability at all is reported at the smallest float."""
    return x if math.isfinite(x) else -9999.0


def chat_entry(names: TokenNames, lp: TokenLogprob, top_n: int) -> dict[str, object]:
    """One `choices[].logprobs.content[]` entry."""
    def one(token_id: int, logprob: float) -> dict[str, object]:
        return {"token": names.text(token_id), "logprob": _finite(logprob), "bytes": list(names.bytes(token_id))}

    return {**one(lp.token_id, lp.logprob), "top_logprobs": [one(t, v) for t, v in lp.top[:top_n]]}


class CompletionLogprobs:
    """The legacy `logprobs` object, built token by token; `text_offset` counts characters of the choice's text
    (the echoed prompt included)."""

    def __init__(self, names: TokenNames, top_n: int, offset: int = 0) -> None:
        self.names, self.top_n, self.offset = names, top_n, offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, token_id: int, lp: TokenLogprob | None) -> dict[str, list[object]]:
        """Append one token; returns the entry alone (for a streamed chunk)."""
        text = self.names.text(token_id)
        top: dict[str, float] | None = None
        if lp is not None:
            top = {}
            for t, v in lp.top[: self.top_n]:  # the true top-k (lm-eval reads greediness from it)
                top.setdefault(self.names.text(t), _finite(v))
        entry = {"tokens": [text], "token_logprobs": [None if lp is None else _finite(lp.logprob)],
                 "top_logprobs": [top], "text_offset": [self.offset]}
        self.tokens.append(text)
        self.token_logprobs.append(entry["token_logprobs"][0])
        self.top_logprobs.append(top)
        self.text_offset.append(self.offset)
        self.offset += len(text)
        return entry

    def json(self) -> dict[str, object]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}
