"""A conversation rendered through the model's chat template, with exact token offsets of its parts.

Each API turns its request into a `Conversation`: turns (tools, system, messages) made of text pieces, some of
which carry a cache breakpoint. `build_prompt` renders it once, tokenizes it once (with character offsets), and
finds where a piece or a turn ends without markers: it renders the conversation cut after that piece, takes the
common prefix with the full rendering, and counts the tokens that end inside it.

Message content (and tool definitions) is plain text: a `<|im_start|>` typed by a user is ordinary characters,
never the control token, so content cannot forge a turn. Only the template's own structure yields special tokens
(unless the operator allows them in content).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import re
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import jinja2

from hafiza.models.tokenizer import Tokenizer
from hafiza.server.errors import ApiError

PIECE_SEPARATOR = "\n"
SENTINEL_TOOL = "\x00"  # a stand-in tool whose rendering differs from any real tool's at its first character


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
    extra: dict[str, object] | None = None

    @property
    def text(self) -> str:
        return PIECE_SEPARATOR.join(p.text for p in self.pieces)


@dataclass
class Conversation:
    """What the model is asked. `continue_final`: the last turn is an assistant prefill the reply continues.

    `tools` (OpenAI function form) go to a chat template that renders them itself, with a cache breakpoint per
    tool in `tool_ttls`; `tool_keys` are digests of the tools in order whichever way they are rendered.
    `template_vars` are extra template variables; `generation_prefix` is text the reply is forced to start with,
    appended after the generation prompt."""

    turns: list[Turn]
    continue_final: bool = False
    tools: list[dict[str, object] | str] | None = None
    tool_ttls: list[str | None] = field(default_factory=list)
    tool_keys: list[str] = field(default_factory=list)
    template_vars: dict[str, object] = field(default_factory=dict)
    generation_prefix: str = ""


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
    tools_span: tuple[int, int] | None = None
    _turn_ends: dict[int, int] = field(default_factory=dict, repr=False)

    @property
    def tool_keys(self) -> list[str]:
        return self.conversation.tool_keys

    def segment_at(self, token: int) -> str:
        """The label of the turn that holds prompt token `token` (the template's generation prompt after them)."""
        if token >= len(self.ids):
            return "end"
        char = self.token_ends[token - 1] if token > 0 else 0
        if self.tools_span is not None and self.tools_span[0] <= char < self.tools_span[1]:
            return "tools"
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
        if i not in self._turn_ends:
            conv = self.conversation
            cut = _cut(conv, conv.turns[: i + 1], conv.continue_final and i == len(conv.turns) - 1)
            self._turn_ends[i] = _common_prefix(render(self.tokenizer, cut, final=False), self.text)
        return self._turn_ends[i]


def render(tokenizer: Tokenizer, conv: Conversation, final: bool = True) -> str:
    """The chat-template text; `final` adds the generation prompt (or leaves a prefill open)."""
    messages = [{"role": t.role, "content": t.text, **(t.extra or {})} for t in conv.turns]
    try:
        if conv.continue_final:
            head = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tools=conv.tools,
                                                 **conv.template_vars)
            return head + str(messages[-1]["content"])
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=final, tools=conv.tools,
                                             **conv.template_vars)
        return text + conv.generation_prefix if final else text
    except jinja2.TemplateError as exc:
        raise ApiError(400, f"the model's chat template rejected the conversation: {exc}") from exc


def encode_with_ends(tokenizer: Tokenizer, text: str,
                     plain_spans: list[tuple[int, int]] | None = None) -> tuple[list[int], list[int]]:
    """Token ids of `text` and each token's end offset in characters; the `plain_spans` (sorted character
    ranges) are read as plain text, the rest exactly as `tokenizer.encode` reads it (special tokens recognised)."""
    return _with_bos(tokenizer, *_encode_regions(tokenizer, text, plain_spans or []))


def _with_bos(tokenizer: Tokenizer, ids: list[int], offsets: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """The ids with BOS first if the model wants it (and the text does not start with it), and the token ends."""
    ends = [end for _, end in offsets]
    if tokenizer.add_bos and tokenizer.bos_token is not None:
        bos = tokenizer.backend.token_to_id(tokenizer.bos_token)
        if bos is not None and (not ids or ids[0] != bos):
            ids, ends = [bos, *ids], [0, *ends]
    return ids, ends


def _encode_regions(tokenizer: Tokenizer, text: str, plain_spans: list[tuple[int, int]]
                    ) -> tuple[list[int], list[tuple[int, int]]]:
    """Encode `text` region by region: template regions with special tokens, `plain_spans` as plain text."""
    if not plain_spans:
        enc = tokenizer.encode_unlocked(text)
        return list(enc.ids), list(enc.offsets)
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    pos = 0
    for start, end in [*plain_spans, (len(text), len(text))]:
        for a, b, plain in ((pos, start, False), (max(pos, start), end, True)):
            if b <= a:
                continue
            if plain:
                part_ids, part_offsets = tokenizer.encode_plain(text[a:b])
            else:
                enc = tokenizer.encode_unlocked(text[a:b])
                part_ids, part_offsets = list(enc.ids), list(enc.offsets)
            ids += part_ids
            offsets += [(a + s, a + e) for s, e in part_offsets]
        pos = max(pos, end)
    return ids, offsets


def encode_conversation(tokenizer: Tokenizer, conv: Conversation, text: str,
                        allow_special_in_content: bool = False) -> tuple[list[int], list[int]]:
    """Token ids and ends of `text`, the rendering of `conv`. A content span (or the tool definitions) that would
    yield a special token is read as plain text; everything else is tokenized as one text, so ordinary prompts
    get exactly `tokenizer.encode`'s ids. `allow_special_in_content` keeps special tokens spelled in content."""
    tools_text = json.dumps(conv.tools, ensure_ascii=False) if conv.tools else ""
    if allow_special_in_content or not any(tokenizer.spells_special(t) for t in [tools_text, *_contents(conv)]):
        return encode_with_ends(tokenizer, text)
    special = tokenizer.special_ids
    ids, offsets = _encode_regions(tokenizer, text, [])
    hits = [off for i, off in zip(ids, offsets, strict=True) if i in special]
    if not hits:
        return _with_bos(tokenizer, ids, offsets)
    spans = content_spans(tokenizer, conv, text) + _extra_spans(tokenizer, conv, text)
    if conv.tools:
        spans.append(_tools_span(tokenizer, conv, text))
    spans = _merged(sp for sp in spans if sp[1] > sp[0])
    starts = [a for a, _ in spans]
    plain: set[tuple[int, int]] = set()
    while True:
        new: set[tuple[int, int]] = set()
        for hs, he in hits:
            k = bisect.bisect_left(starts, he) - 1  # the spans starting before the hit ends
            while k >= 0 and spans[k][1] > hs:
                new.add(spans[k])
                k -= 1
        new -= plain
        if not new:
            return _with_bos(tokenizer, ids, offsets)
        plain |= new
        ids, offsets = _encode_regions(tokenizer, text, sorted(plain))
        hits = [off for i, off in zip(ids, offsets, strict=True) if i in special]


def _merged(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, non-overlapping character ranges covering `spans`."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _extra_spans(tokenizer: Tokenizer, conv: Conversation, text: str) -> list[tuple[int, int]]:
    """Where the strings of turn extras (earlier tool calls' names and arguments) that spell a special token are
    rendered: the difference between `text` and a rendering with that one string emptied."""
    spans: list[tuple[int, int]] = []
    for i, turn in enumerate(conv.turns):
        for path, value in _string_leaves(turn.extra or {}, ()):
            if not tokenizer.spells_special(value):
                continue
            extra = _replaced(turn.extra or {}, path, "")
            assert isinstance(extra, dict)
            emptied = Turn(turn.role, turn.label, turn.pieces, extra)
            other = render(tokenizer, dataclasses.replace(conv, turns=[*conv.turns[:i], emptied,
                                                                         *conv.turns[i + 1:]]))
            head = _common_prefix(text, other)
            tail = min(_common_prefix(text[::-1], other[::-1]), len(text) - head, len(other) - head)
            spans.append((head, len(text) - tail))
    return spans


def _string_leaves(value: object, path: tuple[object, ...]) -> Iterator[tuple[tuple[object, ...], str]]:
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _string_leaves(v, (*path, k))
    elif isinstance(value, list):
        for k, v in enumerate(value):
            yield from _string_leaves(v, (*path, k))


def _replaced(value: object, path: tuple[object, ...], new: str) -> object:
    """A copy of `value` with the leaf at `path` set to `new`."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {k: _replaced(v, rest, new) if k == head else v for k, v in value.items()}
    assert isinstance(value, list)
    return [_replaced(v, rest, new) if k == head else v for k, v in enumerate(value)]


def _contents(conv: Conversation) -> list[str]:
    """Every client-supplied text of the conversation: turn contents and the strings in turn extras."""
    out = [t.text for t in conv.turns]
    for t in conv.turns:
        if t.extra:
            out.append(json.dumps(t.extra, ensure_ascii=False))
    return out


def content_spans(tokenizer: Tokenizer, conv: Conversation, text: str) -> list[tuple[int, int]]:
    """Where each turn's content lies in `text`, the rendering of `conv`: the template is rendered once more with
    a unique marker in place of each content and the markers are located (a template that trims content is
    allowed for). 400 if the template rewrites content so that where it lies cannot be known."""
    nonce = secrets.token_hex(8)
    marked = dataclasses.replace(conv, turns=[  # empty content stays empty: templates test it ("if content")
        Turn(t.role, t.label, [Piece(f"\ue000{nonce}:{i}\ue001" if t.text else "")], t.extra)
        for i, t in enumerate(conv.turns)])
    parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", render(tokenizer, marked))
    for strip in (False, True):
        contents = [t.text.strip() if strip else t.text for t in conv.turns]
        out: list[str] = []
        spans: list[tuple[int, int]] = []
        pos = 0
        for k, part in enumerate(parts):
            piece = contents[int(part)] if k % 2 else part
            if k % 2:
                spans.append((pos, pos + len(piece)))
            out.append(piece)
            pos += len(piece)
        if "".join(out) == text:
            return spans
    raise ApiError(400, "the message content spells a special token of the model (such as a turn marker) and the "
                        "model's chat template rewrites content, so it cannot be kept as plain text: remove the "
                        "special-token text from the messages")


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


def build_prompt(tokenizer: Tokenizer, conv: Conversation, allow_special_in_content: bool = False,
                 max_chars: int | None = None) -> Prompt:
    """Render, tokenize, and place every breakpoint at its exact token offset. 400 past `max_chars` characters
    (checked on the content before rendering it, then on the rendering)."""
    if max_chars is not None:
        content = sum(len(t.text) for t in conv.turns)
        if content > max_chars:
            raise ApiError(400, f"the messages hold {content} characters of text; the limit is {max_chars}")
    text = render(tokenizer, conv)
    if max_chars is not None and len(text) > max_chars:
        raise ApiError(400, f"the rendered prompt is {len(text)} characters; the limit is {max_chars}")
    ids, ends = encode_conversation(tokenizer, conv, text, allow_special_in_content)
    breakpoints: list[Breakpoint] = []
    for i, turn in enumerate(conv.turns):
        for j, piece in enumerate(turn.pieces):
            if piece.ttl is None:
                continue
            cut_turn = Turn(turn.role, turn.label, turn.pieces[: j + 1], turn.extra)
            cut = _cut(conv, [*conv.turns[:i], cut_turn], conv.continue_final and i == len(conv.turns) - 1)
            char = _common_prefix(render(tokenizer, cut, final=False), text)
            breakpoints.append(Breakpoint(tokens_within(ends, char), piece.ttl, turn.label))
    hashes = {t.label: _digest(t.role, t.text) for t in conv.turns}
    span = None
    if conv.tools:
        span = _tools_span(tokenizer, conv, text)
        hashes["tools"] = _digest("tools", json.dumps(conv.tools, sort_keys=False))
        for j, ttl in enumerate(conv.tool_ttls):
            if ttl is not None:
                char = _common_prefix(_with_tools(tokenizer, conv, [*conv.tools[: j + 1], SENTINEL_TOOL]), text)
                breakpoints.append(Breakpoint(_stable_tokens(tokenizer, text, ids, ends, char), ttl, "tools"))
        breakpoints.sort(key=lambda b: b.tokens)
    return Prompt(conv, text, ids, breakpoints, hashes, ends, tokenizer, span)


def _stable_tokens(tokenizer: Tokenizer, text: str, ids: list[int], ends: list[int], char: int,
                   tries: int = 8) -> int:
    """The leading tokens within `char` whose text tokenizes to exactly them (a cut between two tools' JSON may
    fall where the whitespace around it merges differently on its own), so a later prompt sharing only that text
    shares those tokens."""
    k = tokens_within(ends, char)
    for _ in range(tries):
        if k == 0 or tokenizer.encode(text[: ends[k - 1]]) == ids[:k]:
            break
        k -= 1
    return k


def _cut(conv: Conversation, turns: list[Turn], continue_final: bool) -> Conversation:
    """`conv` with only `turns`, its tools and template variables kept, without the forced reply prefix."""
    return Conversation(turns, continue_final, conv.tools, conv.tool_ttls, conv.tool_keys, conv.template_vars)


def _tools_span(tokenizer: Tokenizer, conv: Conversation, text: str) -> tuple[int, int]:
    """The characters of `text` that render the conversation's tools."""
    assert conv.tools
    start = _common_prefix(_with_tools(tokenizer, conv, [SENTINEL_TOOL]), text)
    end = _common_prefix(_with_tools(tokenizer, conv, [*conv.tools, SENTINEL_TOOL]), text)
    return start, max(start, end)


def _with_tools(tokenizer: Tokenizer, conv: Conversation, tools: list[dict[str, object] | str]) -> str:
    """The full rendering with `tools` in place of the conversation's (to locate where the tools lie)."""
    alt = Conversation(conv.turns, conv.continue_final, tools, [], conv.tool_keys, conv.template_vars,
                       conv.generation_prefix)
    return render(tokenizer, alt)


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
