"""The n choices of one request, read from the engine's interleaved outputs: each choice's reply (text and tool
calls), finish, token count and logprobs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hafiza.engine.results import RequestOutput
from hafiza.server.tools.parse import Part
from hafiza.server.tools.reply import ReplyReader


@dataclass
class Choice:
    """One choice as far as it has been read."""

    index: int
    reader: ReplyReader
    finished: bool = False
    finish_reason: str | None = None
    stop_sequence: str | None = None
    output_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[object] = field(default_factory=list)


@dataclass
class Step:
    """What one engine output added to its choice."""

    choice: Choice
    parts: list[Part]
    out: RequestOutput


class Choices:
    """Routes outputs to their choice (`RequestOutput.index`); done when all n have finished."""

    def __init__(self, n: int, make_reader: Callable[[], ReplyReader]) -> None:
        self.items = [Choice(i, make_reader()) for i in range(n)]

    def feed(self, out: RequestOutput) -> Step:
        choice = self.items[out.index]
        parts = choice.reader.feed(out)
        choice.token_ids += out.new_token_ids
        choice.logprobs += list(out.logprobs or [])
        choice.output_tokens = out.num_output_tokens
        if out.finished:
            choice.finished, choice.finish_reason, choice.stop_sequence = True, out.finish_reason, out.stop_sequence
            parts += choice.reader.finish()
        return Step(choice, parts, out)

    @property
    def done(self) -> bool:
        return all(c.finished for c in self.items)

    @property
    def output_tokens(self) -> int:
        return sum(c.output_tokens for c in self.items)
