"""DraftBudget: rejected drafts shrink the next ones, then pause drafting for doubling spans."""

from __future__ import annotations

from hafiza.engine.speculative import DraftBudget
from hafiza.engine.speculative.backoff import MAX_PAUSE


def test_full_acceptance_keeps_the_full_length() -> None:
    budget = DraftBudget(4)
    assert budget.allowed() == 4
    budget.record(4, 4)
    assert budget.allowed() == 4


def test_full_acceptance_of_a_short_draft_doubles_it() -> None:
    """A proposer that found only one token to draft earns two next time, not the full eight."""
    budget = DraftBudget(8)
    budget.record(1, 1)
    assert budget.allowed() == 2
    budget.record(2, 2)
    assert budget.allowed() == 4
    budget.record(4, 4)
    budget.record(8, 8)
    assert budget.allowed() == 8


def test_partial_acceptance_drafts_one_more_than_accepted() -> None:
    budget = DraftBudget(5)
    budget.record(5, 2)
    assert budget.allowed() == 3
    budget.record(3, 3)
    assert budget.allowed() == 5  # 2 × 3, capped


def test_rejections_halve_then_pause_for_doubling_spans() -> None:
    budget = DraftBudget(4)
    budget.record(4, 0)
    assert budget.allowed() == 2
    budget.record(2, 0)
    assert budget.allowed() == 1
    budget.record(1, 0)
    assert [budget.allowed() for _ in range(2)] == [0, 1]  # a pause of 1 step
    budget.record(1, 0)
    assert [budget.allowed() for _ in range(3)] == [0, 0, 1]  # then 2
    for _ in range(20):
        budget.record(1, 0)
    assert budget.next_pause == MAX_PAUSE


def test_acceptance_after_a_pause_resets_it() -> None:
    budget = DraftBudget(4)
    for drafted in (4, 2, 1):
        budget.record(drafted, 0)
    assert budget.allowed() == 0
    assert budget.allowed() == 1
    budget.record(1, 1)
    assert budget.allowed() == 2 and budget.next_pause == 1


def test_nothing_drafted_changes_nothing() -> None:
    budget = DraftBudget(3)
    budget.record(0, 0)
    assert budget.allowed() == 3
