"""One measurement: a coder (or peer) on one text's K and V, with sizes, one-thread timings and a checked
round trip. Times are CPU seconds of this (single-threaded) process, so that other users of a shared
machine slow the wall clock but not the figures; a decode's time is the median of DECODE_REPEATS decodes,
since on a loaded machine one decode can take twice as long as the next."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch

from hafiza.codec import CodecContext, decode, encode
from hafiza.codec.formats import tensor_bits

DECODE_REPEATS = 3
T = TypeVar("T")


@dataclass
class Measurement:
    """Sizes and times for one coder on one text, K and V separately."""

    label: str
    kind: str
    kv_dtype: str
    values: dict[str, int] = field(default_factory=dict)
    raw_bytes: dict[str, int] = field(default_factory=dict)
    coded_bytes: dict[str, int] = field(default_factory=dict)
    encode_s: dict[str, float] = field(default_factory=dict)
    decode_s: dict[str, float] = field(default_factory=dict)
    lossless: bool = True
    predictor_s: float = 0.0


def entropy0(bits: np.ndarray) -> float:
    """Zero-order entropy of the bit patterns, in bits per value."""
    _, counts = np.unique(bits.reshape(-1), return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(tensor_bits(a), tensor_bits(b)))


def measure_codec(label: str, kv: dict[str, torch.Tensor], make_context: Callable[[str], CodecContext],
                  fresh_context: Callable[[str], CodecContext] | None = None) -> Measurement:
    """encode/decode each role; `fresh_context` (if given) decodes once more with a new predictor instance,
    which reruns the prediction, to prove it reproducible; the timed decode reuses the encoder's."""
    m = Measurement(label, "hafiza", str(next(iter(kv.values())).dtype).replace("torch.", ""))
    for role, x in kv.items():
        ctx = make_context(role)
        start = time.process_time()
        data = encode(x, ctx)
        m.encode_s[role] = time.process_time() - start
        y, m.decode_s[role] = _timed(lambda data=data, ctx=ctx: decode(data, ctx))
        ok = same(x, y)
        if fresh_context is not None:
            ok = ok and same(x, decode(data, fresh_context(role)))
        m.lossless = m.lossless and ok
        m.values[role], m.raw_bytes[role] = x.numel(), x.numel() * x.element_size()
        m.coded_bytes[role] = len(data)
    return m


def measure_bytes(label: str, kv: dict[str, torch.Tensor], compress: Callable[[bytes], bytes],
                  decompress: Callable[[bytes], bytes]) -> Measurement:
    """A peer that codes raw bytes: each role's tensor bytes, compressed and restored."""
    m = Measurement(label, "peer", str(next(iter(kv.values())).dtype).replace("torch.", ""))
    for role, x in kv.items():
        raw = tensor_bits(x).tobytes()
        start = time.process_time()
        data = compress(raw)
        m.encode_s[role] = time.process_time() - start
        back, m.decode_s[role] = _timed(lambda data=data: decompress(data))
        m.lossless = m.lossless and bytes(back) == raw
        m.values[role], m.raw_bytes[role], m.coded_bytes[role] = x.numel(), len(raw), len(data)
    return m


def _timed(run: Callable[[], T]) -> tuple[T, float]:
    """The last result of `run` and the median CPU time of DECODE_REPEATS runs."""
    times = []
    for _ in range(DECODE_REPEATS):
        start = time.process_time()
        result = run()
        times.append(time.process_time() - start)
    return result, float(np.median(times))
