"""Verification of one drafted run: plain decoding replayed over the rows a single forward step computed.

A sequence with drafted tokens d_0..d_{k-1} runs k + 1 rows in one step: its last known token, then each draft.
Row j's logits predict the token after d_{j-1}, so they are the logits plain decoding would see at that position
whenever d_0..d_{j-1} were all accepted (the forward is row-invariant). `verify` samples row 0, then row j only
while the tokens before it matched the draft, each time as plain decoding samples (same penalties, grammar mask,
temperature and generator), and emits every sampled token. The run ends at the first token that differs from
the draft (that token is kept: it is the correction), after the last row (the bonus token), or at a stop.

Greedy output is therefore plain output, bit for bit. With temperature > 0 it is standard speculative rejection
sampling for a point-mass draft: the drafted token t is kept with probability p(t), and a rejection yields a
sample of p with t removed and renormalised, exactly what drawing from p and comparing with t does. Each emitted
token costs one draw of the request's generator, as in plain decoding, so seeded output is unchanged too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Sample = Callable[[int], int | None]  # row j -> the token plain decoding samples there (None: sampling failed)
Emit = Callable[[int], bool]  # token -> append it, apply the stop conditions; False once the sequence stopped


def verify(draft: Sequence[int], sample: Sample, emit: Emit) -> int:
    """Sample and emit tokens row by row while they equal `draft`; returns how many drafted tokens were accepted
    (emitted as the sequence's own). `sample(j)` is called only once the j tokens before row j were accepted, so
    the caller may treat that call as "row j's input is now a known token"."""
    accepted = 0
    for j in range(len(draft) + 1):
        token = sample(j)
        if token is None:
            break
        live = emit(token)
        if j == len(draft) or token != draft[j]:
            break
        accepted += 1
        if not live:
            break
    return accepted
