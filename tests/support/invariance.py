"""Row-invariance check for any row-wise op (a linear layer, a norm): row i of the output must depend only on row i
of the input, bit for bit, whatever the row count, the row's position in the batch and the thread count."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 16, 17, 33, 64, 100, 257)


def assert_row_invariant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                         row_counts: Sequence[int] = ROW_COUNTS, offsets: Sequence[int] = (0, 1, 6),
                         threads: Sequence[int] = (1, 2, 3)) -> None:
    """For every thread count, row count m and offset o: fn(x[o:o+m]) equals, row by row, fn applied to each of
    those rows alone (computed with the first thread count). `x` needs max(row_counts) + max(offsets) rows."""
    need = max(row_counts) + max(offsets)
    assert x.shape[0] >= need, f"x has {x.shape[0]} rows, the check needs {need}"
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads[0])
        alone = torch.cat([fn(x[i : i + 1]) for i in range(need)])
        for t in threads:
            torch.set_num_threads(t)
            for m in row_counts:
                for o in offsets:
                    got = fn(x[o : o + m])
                    want = alone[o : o + m]
                    assert got.shape == want.shape, f"{m} rows gave shape {tuple(got.shape)}"
                    diff = (got != want).any(dim=-1).nonzero().flatten().tolist()
                    assert not diff, (
                        f"{threads[0]}->{t} threads, {m} rows at offset {o}: rows {diff[:5]} differ from the row "
                        f"computed alone by up to {(got - want).abs().max().item():.3g}")
    finally:
        torch.set_num_threads(before)
