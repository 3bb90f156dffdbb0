"""verify on hand-built logits: greedy acceptance, the correction and bonus tokens, stops, and sampling that keeps
the target distribution (temperature > 0)."""

from __future__ import annotations

import math

import pytest
import torch

from hafiza.engine.sampling import SamplingParams, sample
from hafiza.engine.speculative.verify import verify

V = 6


def rows(*argmaxes: int) -> torch.Tensor:
    """One row per position whose argmax is the given token."""
    out = torch.zeros(len(argmaxes), V)
    for j, t in enumerate(argmaxes):
        out[j, t] = 5.0
    return out


def run(draft: list[int], logits: torch.Tensor, params: SamplingParams, stop_after: int | None = None,
        generator: torch.Generator | None = None) -> tuple[int, list[int], list[int]]:
    """(accepted, emitted tokens, rows sampled)."""
    emitted: list[int] = []
    used: list[int] = []

    def pick(j: int) -> int:
        used.append(j)
        return sample(logits[j : j + 1], [params], [generator])[0]

    def emit(token: int) -> bool:
        emitted.append(token)
        return stop_after is None or len(emitted) < stop_after

    return verify(draft, pick, emit), emitted, used


GREEDY = SamplingParams(temperature=0)


def test_all_accepted_plus_bonus() -> None:
    assert run([3, 1, 4], rows(3, 1, 4, 2), GREEDY) == (3, [3, 1, 4, 2], [0, 1, 2, 3])


def test_first_mismatch_is_the_correction() -> None:
    assert run([3, 1, 4], rows(3, 5, 4, 2), GREEDY) == (1, [3, 5], [0, 1])
    assert run([3, 1, 4], rows(0, 1, 4, 2), GREEDY) == (0, [0], [0])


def test_stop_inside_the_run_discards_the_rest() -> None:
    assert run([3, 1, 4], rows(3, 1, 4, 2), GREEDY, stop_after=2) == (2, [3, 1], [0, 1])
    assert run([3, 1, 4], rows(3, 1, 4, 2), GREEDY, stop_after=1) == (1, [3], [0])


def test_no_draft_is_one_plain_step() -> None:
    assert run([], rows(2), GREEDY) == (0, [2], [0])


def test_failed_sampling_ends_the_run() -> None:
    emitted: list[int] = []
    got = verify([1, 2], lambda j: None if j == 1 else 1, lambda t: emitted.append(t) is None)
    assert got == 1 and emitted == [1]


P = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0, 0.0])


@pytest.mark.parametrize("drafted", [0, 3, 5])
def test_sampling_keeps_the_target_distribution(drafted: int) -> None:
    """Position 0's token over 4,000 seeded runs against p by a chi-square test (3 degrees of freedom, critical value
    16.27: a false alarm once in 1,000 runs of this test), whether the drafted token is likely, rare or impossible;
    and the acceptance rate is p(draft), as rejection sampling of a point-mass draft gives."""
    logits = torch.log(P.clamp_min(1e-30)).repeat(2, 1)
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(1234)
    counts = [0] * V
    accepted = 0
    n = 4000
    for _ in range(n):
        a, emitted, _ = run([drafted], logits, params, generator=gen)
        counts[emitted[0]] += 1
        accepted += a
    assert counts[4] == counts[5] == 0
    chi2 = sum((counts[t] - n * float(P[t])) ** 2 / (n * float(P[t])) for t in range(4))
    assert chi2 < 16.27, counts
    p = float(P[drafted])
    assert abs(accepted / n - p) <= 4 * math.sqrt(max(p * (1 - p), 1e-9) / n) + 1e-9


def test_seeded_sampling_draws_as_plain_decoding() -> None:
    """One generator draw per emitted token: the tokens equal plain sampling's from the same seed."""
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(7))
    params = SamplingParams(temperature=0.9)
    plain_gen = torch.Generator().manual_seed(99)
    plain = [sample(logits[j : j + 1], [params], [plain_gen])[0] for j in range(5)]
    spec_gen = torch.Generator().manual_seed(99)
    _, emitted, _ = run(plain[:4], logits, params, generator=spec_gen)
    assert emitted == plain
