"""A conversation rendered through the model's chat template, with exact token offsets of its parts.

Each API turns its request into a `Conversation`: turns (tools, system, messages) made of text pieces, some of
which carry a cache breakpoint. `build_prompt` renders it once, tokenizes it once (with character offsets), and
finds where a piece or a turn ends without markers: it renders the conversation cut after that piece, takes the
common prefix with the full rendering, and counts the tokens that end inside it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import jinja2

from hafiza.models.tokenizer import Tokenizer
from hafiza.server.errors import ApiError

PIECE_SEPARATOR = "\n"


@dataclass
class Piece:
    """A text block; `ttl` is set when the block carries a cache_control breakpoint."""

    text: str
    ttl: str | None = None


@dataclass
class Turn:
    """One chat-template message. `label` names it in cache explanations: tools, system, message[i]."""

    role: str
    label: str
    pieces: list[Piece]

    @property
    def text(self) -> str:
        return PIECE_SEPARATOR.join(p.text for p in self.pieces)


@dataclass
class Conversation:
    """What the model is asked. `continue_final`: the last turn is an assistant prefill the reply continues."""

    turns: list[Turn]
    continue_final: bool = False


@dataclass(frozen=True)
class Breakpoint:
    """A cache breakpoint: the first `tokens` prompt tokens, kept for `ttl`; `label` is the turn it is in."""

    tokens: int
    ttl: str
    label: str


@dataclass
class Prompt:
    """The rendered prompt, its token ids, its breakpoints in order, and per-turn content hashes."""

    conversation: Conversation
    text: str
    ids: list[int]
    breakpoints: list[Breakpoint]
    segment_hashes: dict[str, str]
    token_ends: list[int] = field(repr=False)
    tokenizer: Tokenizer = field(repr=False)

    def segment_at(self, token: int) -> str:
        """The label of the turn that holds prompt token `token` (the template's generation prompt after them)."""
        if token >= len(self.ids):
            return "end"
        char = self.token_ends[token - 1] if token > 0 else 0
        turns = self.conversation.turns
        lo, hi = 0, len(turns)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._turn_end(mid) > char:
                hi = mid
            else:
                lo = mid + 1
        return turns[lo].label if lo < len(turns) else "generation_prompt"

    def _turn_end(self, i: int) -> int:
        conv = self.conversation
        cut = Conversation(conv.turns[: i + 1], conv.continue_final and i == len(conv.turns) - 1)
        return _common_prefix(render(self.tokenizer, cut, final=False), self.text)


def render(tokenizer: Tokenizer, conv: Conversation, final: bool = True) -> str:
    """The chat-template text; `final` adds the generation prompt (or leaves a prefill open)."""
    messages = [{"role": t.role, "content": t.text} for t in conv.turns]
    try:
        if conv.continue_final:
            head = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True)
            return head + messages[-1]["content"]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=final)
    except jinja2.TemplateError as exc:
        raise ApiError(400, f"the model's chat template rejected the conversation: {exc}") from exc


def encode_with_ends(tokenizer: Tokenizer, text: str) -> tuple[list[int], list[int]]:
    """Token ids exactly as `tokenizer.encode` gives them, and each token's end offset in characters."""
    enc = tokenizer.backend.encode(text, add_special_tokens=False)
    ids, ends = list(enc.ids), [end for _, end in enc.offsets]
    if tokenizer.add_bos and tokenizer.bos_token is not None:
        bos = tokenizer.backend.token_to_id(tokenizer.bos_token)
        if bos is not None and (not ids or ids[0] != bos):
            ids, ends = [bos, *ids], [0, *ends]
    return ids, ends


def tokens_within(ends: list[int], char: int) -> int:
    """How many leading tokens end at or before character `char` (a straddling token is not counted)."""
    lo, hi = 0, len(ends)
    while lo < hi:
        mid = (lo + hi) // 2
        if ends[mid] <= char:
            lo = mid + 1
        else:
            hi = mid
    return lo


def build_prompt(tokenizer: Tokenizer, conv: Conversation) -> Prompt:
    """Render, tokenize, and place every breakpoint at its exact token offset."""
    text = render(tokenizer, conv)
    ids, ends = encode_with_ends(tokenizer, text)
    breakpoints: list[Breakpoint] = []
    for i, turn in enumerate(conv.turns):
        for j, piece in enumerate(turn.pieces):
            if piece.ttl is None:
                continue
            cut_turn = Turn(turn.role, turn.label, turn.pieces[: j + 1])
            cut = Conversation([*conv.turns[:i], cut_turn], conv.continue_final and i == len(conv.turns) - 1)
            char = _common_prefix(render(tokenizer, cut, final=False), text)
            breakpoints.append(Breakpoint(tokens_within(ends, char), piece.ttl, turn.label))
    hashes = {t.label: _digest(t.role, t.text) for t in conv.turns}
    return Prompt(conv, text, ids, breakpoints, hashes, ends, tokenizer)


def _digest(role: str, text: str) -> str:
    return hashlib.blake2b(f"{role}\x00{text}".encode(), digest_size=8).hexdigest()


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings (by halving, so long prompts stay cheap)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
