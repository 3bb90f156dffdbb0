"""CacheExplainer: the reason given for each kind of miss, from token ids alone (no server needed)."""

from __future__ import annotations

import logging

import pytest

from hafiza.models import LoadedModel
from hafiza.server.explain import CacheExplainer
from hafiza.server.prompt import Conversation, Piece, Turn, build_prompt


def prompt(tok, system: str, *user: str):
    turns = [Turn("system", "system", [Piece(system)])]
    turns += [Turn("user", f"messages[{i}]", [Piece(u)]) for i, u in enumerate(user)]
    return build_prompt(tok, Conversation(turns))


def test_reasons(default_model: LoadedModel) -> None:
    tok = default_model.tokenizer
    ex = CacheExplainer(block_size=16, details=True)
    system = "You answer questions about a long shared handbook. " * 8
    a = prompt(tok, system, "First question?")
    first = ex.explain("a", a, cached=0, arrival=0.0, computed_at=1.0)
    assert (first.status, first.reason) == ("miss", "no_history")

    full = (len(a.ids) - 1) // 16 * 16
    again = ex.explain("a2", a, cached=full, arrival=2.0, computed_at=3.0)
    assert again.status == "hit" and again.reason is None
    assert again.header() == f"hit; reused={full}; prompt={len(a.ids)}"

    b = prompt(tok, system, "First question?", "Second question?")
    evicted = ex.explain("b", b, cached=0, arrival=5.0, computed_at=6.0)
    assert (evicted.status, evicted.reason, evicted.similar) == ("miss", "evicted", "a2")

    c = prompt(tok, system, "Another first question?")
    racing = ex.explain("c", c, cached=0, arrival=4.0, computed_at=7.0)
    assert racing.reason == "in_flight" and racing.at == "messages[0]"

    d = prompt(tok, system, "Yet another question about chapter seven, section two, paragraph four, line nine?")
    common = next(i for i, (x, y) in enumerate(zip(c.ids, d.ids, strict=False)) if x != y)
    diverged = ex.explain("d", d, cached=common // 16 * 16, arrival=8.0, computed_at=9.0)
    assert (diverged.status, diverged.reason, diverged.at, diverged.offset) == ("partial", "diverged", "messages[0]",
                                                                                common)

    short = ex.explain("e", prompt(tok, "Hi."), cached=0, arrival=10.0, computed_at=11.0)
    assert short.reason in ("short", "no_history", "diverged")
    tiny = build_prompt(tok, Conversation([Turn("user", "messages[0]", [Piece("x")])], continue_final=True))
    assert ex.explain("f", tiny, cached=0, arrival=12.0, computed_at=13.0).reason == "short"


def test_history_is_bounded_and_deduplicated(default_model: LoadedModel) -> None:
    tok = default_model.tokenizer
    ex = CacheExplainer(block_size=16, history=3)
    p = prompt(tok, "Same system prompt for all of these requests, long enough for a block.", "Same?")
    for i in range(5):
        ex.explain(f"r{i}", p, cached=0, arrival=float(i), computed_at=float(i))
    assert list(ex.seen) == ["r4"]
    for i in range(5):
        ex.explain(f"s{i}", prompt(tok, f"System {i} " * 10, "q"), cached=0, arrival=9.0, computed_at=9.0)
    assert len(ex.seen) == 3


def test_default_names_no_other_request_and_no_offset(default_model: LoadedModel,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    tok = default_model.tokenizer
    ex = CacheExplainer(block_size=16)
    system = "You answer questions about a long shared handbook. " * 8
    a = prompt(tok, system, "The PIN is 4821. Then what does chapter seven of the handbook say about safety rules?")
    ex.explain("a", a, cached=0, arrival=0.0, computed_at=1.0)
    b = prompt(tok, system, "The PIN is 4829. Then what does chapter seven of the handbook say about safety rules?")
    common = next(i for i, (x, y) in enumerate(zip(a.ids, b.ids, strict=False)) if x != y)
    with caplog.at_level(logging.INFO, logger="hafiza.server.cache"):
        got = ex.explain("b", b, cached=common // 16 * 16, arrival=2.0, computed_at=3.0)
    assert got.reason == "diverged"
    assert "offset=" not in got.header() and "similar=" not in got.header() and "at=" not in got.header()
    assert f"offset={common}; similar=a" in caplog.text  # the operator's log keeps them


def test_other_partitions_are_never_compared(default_model: LoadedModel) -> None:
    tok = default_model.tokenizer
    ex = CacheExplainer(block_size=16, details=True)
    system = "You answer questions about a long shared handbook. " * 8
    ex.explain("a", prompt(tok, system, "The PIN is 4821."), cached=0, arrival=0.0, computed_at=1.0,
               partition="tenant-a")
    other = ex.explain("b", prompt(tok, system, "The PIN is 4829."), cached=0, arrival=2.0, computed_at=3.0,
                       partition="tenant-b")
    assert (other.reason, other.similar, other.offset) == ("no_history", None, None)
    same = ex.explain("c", prompt(tok, system, "The PIN is 4829."), cached=0, arrival=4.0, computed_at=5.0,
                      partition="tenant-a")
    assert same.similar == "a" and same.offset is not None
