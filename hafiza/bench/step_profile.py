"""Where a decode step's time goes, per part: the matmuls (every layer's linears and the head), attention, norms,
rope, K/V writes, and the rest (embedding, residual adds, SiLU, sampling, scheduling, Python).

For `hafiza bench weights`: its worker decodes once more with the model's parts timed. The linears are wrapped in
place (LayerWeights fields and the head), and the llama module's attention, norm and rope functions are swapped for
timed ones. Every part keeps its own code and values, and the wrappers add well under 1 % to a step. Everything is
put back on exit. CPU only: each call is timed as it returns, and the CPU has no asynchronous queue.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, ParamSpec, TypeVar

import torch

from hafiza.cache.formats.base import PoolFormat
from hafiza.models import llama
from hafiza.models.linear import Linear, RefinedHead

if TYPE_CHECKING:
    from hafiza.models.llama import LlamaModel

P = ParamSpec("P")
R = TypeVar("R")
PARTS = ("matmul", "attention", "norm", "rope", "kv_write")
LAYER_FUNCTIONS = {"paged_attention": "attention", "rms_norm": "norm", "apply_rope": "rope"}


@dataclass
class PartClock:
    """Seconds spent in each part while the clock runs; nested parts count once, in the outermost."""

    seconds: Counter[str] = field(default_factory=Counter)
    depth: int = 0

    def timed(self, part: str, fn: Callable[P, R]) -> Callable[P, R]:
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start
                self.depth -= 1

        return run


class TimedLinear:
    """A linear whose calls the clock counts as matmul time; everything else is the wrapped linear's."""

    def __init__(self, inner: Linear, clock: PartClock) -> None:
        self.inner, self.kind = inner, inner.kind
        self.out_features, self.in_features = inner.out_features, inner.in_features
        self._call = clock.timed("matmul", inner.__call__)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._call(x)

    def dense(self) -> torch.Tensor:
        return self.inner.dense()

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes


@contextmanager
def timed_parts(model: LlamaModel) -> Iterator[PartClock]:
    """Time `model`'s parts for the duration; the model is as it was afterwards."""
    if model.device.type != "cpu":
        raise ValueError("timed_parts times CPU forwards only (a CUDA kernel returns before it has run)")
    clock = PartClock()
    layers = [(lw, f.name, getattr(lw, f.name)) for lw in model.layers for f in fields(lw)
              if f.name in ("qkv", "o", "gate_up", "down")]
    functions = {name: getattr(llama, name) for name in LAYER_FUNCTIONS}
    head, write = model.lm_head, PoolFormat.write
    base = head.base if isinstance(head, RefinedHead) else head  # a refined head's refinement is `other`
    try:
        for lw, name, lin in layers:
            setattr(lw, name, TimedLinear(lin, clock))
        for name, fn in functions.items():
            setattr(llama, name, clock.timed(LAYER_FUNCTIONS[name], fn))
        if isinstance(head, RefinedHead):
            head.base = TimedLinear(head.base, clock)
        else:
            model.lm_head = TimedLinear(head, clock)
        PoolFormat.write = clock.timed("kv_write", write)  # type: ignore[method-assign]
        yield clock
    finally:
        for lw, name, lin in layers:
            setattr(lw, name, lin)
        for name, fn in functions.items():
            setattr(llama, name, fn)
        model.lm_head = head
        if isinstance(head, RefinedHead):
            head.base = base
        PoolFormat.write = write  # type: ignore[method-assign]


def step_parts_ms(clock: PartClock, step_s: float, steps: int) -> dict[str, float]:
    """Milliseconds per step of each part, `other` (the step less every part) and `step`."""
    out = {p: clock.seconds[p] * 1000 / steps for p in PARTS}
    out["other"] = step_s * 1000 / steps - sum(out.values())
    out["step"] = step_s * 1000 / steps
    return out
