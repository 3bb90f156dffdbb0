"""GGUF blocks multiplied by ggml's own CPU kernels (ggml-python), as the file ships them.

ggml quantizes each input row to the weight type's dot partner (Q8_0 or Q8_K) and runs its integer-dot kernel
per output value, so row m of the output depends only on row m of the input, whatever the number of rows or
threads (tests/models/test_ggml_linear.py). One graph (one `mul_mat` node) is kept per row count and reused,
and a call only points the graph at the input and output tensors: a few microseconds over the kernel itself.
On AVX2 machines this kernel is 2-4x faster than torch's int4 kernel at one row (docs/WEIGHTS.md).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

# the GGUF types this path multiplies; ggml's own kernels exist for each on every x86 build
GGML_TYPES = frozenset({
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
})
GRAPHS_KEPT = 8  # row counts with a graph kept per weight (decode, verification widths, prefill chunks)


class GGMLUnavailable(RuntimeError):
    """ggml-python is not installed, or this CPU lacks the instructions its library was built for."""


@dataclass(frozen=True)
class _Lib:
    """The ggml functions one call needs, resolved once."""

    ggml: object  # the ggml-python module
    compute: ctypes._CFuncPtr  # type: ignore[name-defined]
    data_offset: int  # byte offset of `data` in struct ggml_tensor


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache
def load_library() -> _Lib:
    """Load ggml-python's library; raises GGMLUnavailable naming what is missing."""
    missing = {"avx2", "fma", "f16c"} - _cpu_flags()
    if missing:  # the library is built with these (Makefile); calling it without them would fault
        raise GGMLUnavailable(f"this CPU lacks {', '.join(sorted(missing))}, which the ggml build requires")
    try:
        import ggml
    except (ImportError, OSError, RuntimeError) as exc:
        raise GGMLUnavailable(f"ggml-python is not usable: {exc}") from None
    compute = ggml.lib.ggml_graph_compute
    compute.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    compute.restype = ctypes.c_int
    return _Lib(ggml, compute, ggml.ggml_tensor.data.offset)


def available() -> bool:
    """Whether ggml's kernels can run in this process."""
    try:
        load_library()
    except GGMLUnavailable:
        return False
    return True


class _Graph:
    """One `mul_mat` of a fixed weight and row count, with its plan and work buffer; `run` repoints its input
    and output at the given tensors."""

    def __init__(self, weight: np.ndarray, qtype: GGMLQuantizationType, n: int, k: int, rows: int,
                 threads: int) -> None:
        lib = load_library()
        g = lib.ggml
        size = 4 * g.ggml_tensor_overhead() + g.ggml_graph_overhead_custom(4, False) + 1024
        self.ctx = g.ggml_init(g.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=True))
        w = g.ggml_new_tensor_2d(self.ctx, int(qtype), k, n)
        x = g.ggml_new_tensor_2d(self.ctx, g.GGML_TYPE_F32, k, rows)
        y = g.ggml_mul_mat(self.ctx, w, x)
        self.graph = g.ggml_new_graph_custom(self.ctx, 4, False)
        g.ggml_build_forward_expand(self.graph, y)
        w.contents.data = weight.ctypes.data
        self.plan = g.ggml_graph_plan(self.graph, threads, None)
        self.work = np.empty(max(int(self.plan.work_size), 1), dtype=np.uint8)
        self.plan.work_data = self.work.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        self._x = ctypes.c_void_p.from_address(ctypes.addressof(x.contents) + lib.data_offset)
        self._y = ctypes.c_void_p.from_address(ctypes.addressof(y.contents) + lib.data_offset)
        self._graph_ptr = ctypes.cast(self.graph, ctypes.c_void_p).value
        self._plan_ptr = ctypes.addressof(self.plan)
        self.threads = threads
        self._compute = lib.compute
        self._free = g.ggml_free

    def run(self, x: torch.Tensor, out: torch.Tensor) -> None:
        self._x.value, self._y.value = x.data_ptr(), out.data_ptr()
        status = self._compute(self._graph_ptr, self._plan_ptr)
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute failed with status {status}")

    def __del__(self) -> None:
        if getattr(self, "ctx", None) is not None:
            self._free(self.ctx)
            self.ctx = None


class GGMLLinear:
    """A GGUF weight [N, K] kept as its own blocks (`raw` [N, row bytes], a view of the mapped file where it can
    be), multiplied by ggml's kernel for its type. x [M, K] in any float dtype -> [M, N] in x's dtype."""

    def __init__(self, raw: np.ndarray, qtype: GGMLQuantizationType, in_features: int) -> None:
        if qtype not in GGML_TYPES:
            raise ValueError(f"ggml kernels take {sorted(t.name for t in GGML_TYPES)}, not {qtype.name}")
        load_library()
        self.raw = raw if raw.flags.c_contiguous else np.ascontiguousarray(raw)
        self.qtype = qtype
        self.out_features, self.in_features = raw.shape[0], in_features
        self.kind = f"ggml-{qtype.name}"
        self._graphs: dict[tuple[int, int], _Graph] = {}

    def _graph(self, rows: int, threads: int) -> _Graph:
        if len(self._graphs) >= GRAPHS_KEPT:
            self._graphs.pop(next(iter(self._graphs)))
        graph = _Graph(self.raw, self.qtype, self.out_features, self.in_features, rows, threads)
        self._graphs[rows, threads] = graph
        return graph

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype is not torch.float32 or not x.is_contiguous() or x.device.type != "cpu":
            if x.device.type != "cpu":
                raise ValueError("ggml kernels run on the CPU; this weight was loaded for the CPU")
            return self(x.float().contiguous()).to(x.dtype)
        rows, threads = x.shape[0], torch.get_num_threads()
        out = torch.empty(rows, self.out_features)
        if rows:
            (self._graphs.get((rows, threads)) or self._graph(rows, threads)).run(x, out)
        return out

    def dense(self) -> torch.Tensor:
        """The weights as fp32 [N, K], gguf's own dequantization of the blocks."""
        from gguf.quants import dequantize

        return torch.from_numpy(dequantize(self.raw, self.qtype).reshape(self.out_features, self.in_features))

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)
