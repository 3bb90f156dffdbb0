"""Prompt lookup: the longest recent n-gram match is continued by what followed it."""

from __future__ import annotations

from hafiza.engine.speculative import NgramProposer


def test_continues_the_last_earlier_occurrence() -> None:
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert NgramProposer(1, 3).propose(tokens, 2) == [7, 8]  # the latest earlier "1 2 3" wins


def test_longer_ngrams_first() -> None:
    tokens = [5, 3, 4, 1, 3, 6, 5, 3]  # "5 3" occurred (followed by 4); "3" alone last occurred before 6
    assert NgramProposer(1, 2).propose(tokens, 1) == [4]
    assert NgramProposer(1, 1).propose(tokens, 1) == [6]


def test_no_match_below_min() -> None:
    tokens = [1, 2, 3, 4, 9, 3, 4]  # only "3 4" repeats
    assert NgramProposer(3, 4).propose(tokens, 4) == []
    assert NgramProposer(2, 4).propose(tokens, 4) == [9, 3, 4]


def test_limit_and_short_inputs() -> None:
    proposer = NgramProposer(1, 2)
    assert proposer.propose([1, 2, 1], 0) == []
    assert proposer.propose([1], 3) == []
    assert proposer.propose([1, 2, 1], 5) == [2, 1]  # the continuation runs to the end of the tokens


def test_token_aligned_matches_only() -> None:
    """Token ids are searched as packed bytes: a byte match straddling two tokens must not count."""
    tokens = [0x01000000, 0x00000002, 5, 0x00000201]  # bytes 00 00 00 01 02 00 00 00 hold 01 02 00 00 at offset 3
    assert NgramProposer(1, 1).propose(tokens, 1) == []
    assert NgramProposer(1, 1).propose([*tokens, 8, 0x00000201], 1) == [8]
