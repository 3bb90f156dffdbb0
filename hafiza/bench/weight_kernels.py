"""`hafiza bench weight-kernels`: torch's packed weight-only kernels against fp32 / bf16 on the default model's
matmul shapes, the measurement behind docs/WEIGHTS.md's choice of int4 (bf16 activations) and int8.

One decode step = every layer's qkv, o, gate_up and down (distinct weights per layer, so reads come from memory)
plus the vocabulary head, for 1..16 rows; and one 3072x576 matmul of many rows (prefill). Medians.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Annotated, Any

import torch
import torch.nn.functional as F
import typer
from rich.console import Console
from rich.table import Table

from hafiza.bench.common import write_json
from hafiza.models.linear import cpu_fp32_linear

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M: qkv, o, gate_up, down
HEAD = (49152, 576)
FORMATS = ("fp32", "bf16", "int4", "int4-fp16", "int8", "int8-fp16", "dyn4")

Op = Callable[[torch.Tensor], torch.Tensor]


def make_op(fmt: str, n: int, k: int, g: torch.Generator) -> Op:
    """A random weight [n, k] in `fmt` and the call that multiplies rows by it."""
    if fmt == "fp32":
        w = torch.randn(n, k, generator=g)
        return lambda x: cpu_fp32_linear(x, w)
    if fmt == "bf16":
        wb = torch.randn(n, k, generator=g).bfloat16()
        return lambda x: F.linear(x.bfloat16(), wb)
    if fmt.startswith("int4"):
        dt = torch.float16 if fmt.endswith("fp16") else torch.bfloat16
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        sz = (torch.rand(k // 32, n, 2, generator=g) * 0.01).to(dt)
        return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(dt), packed, 32, sz)
    if fmt.startswith("int8"):
        dt = torch.float16 if fmt.endswith("fp16") else torch.bfloat16
        w8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        s8 = (torch.rand(n, generator=g) * 0.01).to(dt)
        return lambda x: torch.ops.aten._weight_int8pack_mm(x.to(dt), w8, s8)
    if fmt == "dyn4":
        raw = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
        scales = (torch.rand(n, k // 32, generator=g) * 0.01).bfloat16()
        packed = torch.ops.aten._dyn_quant_pack_4bit_weight(raw, scales, None, 32, k, n)
        return lambda x: torch.ops.aten._dyn_quant_matmul_4bit(x, packed, 32, k, n)
    raise typer.BadParameter(f"unknown format {fmt!r}: {', '.join(FORMATS)}")


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _decode_step(ops: list[list[Op]], xs: list[torch.Tensor]) -> None:
    for layer in ops:
        for x, op in zip(xs, layer, strict=True):
            op(x)


def _one_format(fmt: str, rows: list[int], prefill_rows: int, layers: int, repeats: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    ops = [[make_op(fmt, n, k, g) for n, k in LAYER_SHAPES] for _ in range(layers)]
    head = make_op(fmt, *HEAD, g)
    out: list[dict[str, Any]] = []
    for m in rows:
        xs = [torch.randn(m, k) for _, k in LAYER_SHAPES]
        xh = torch.randn(m, HEAD[1])
        out.append({"format": fmt, "rows": m, "layers_ms": _median_ms(partial(_decode_step, ops, xs), repeats),
                    "head_ms": _median_ms(partial(head, xh), repeats)})
    big = make_op(fmt, 3072, 576, g)
    xp = torch.randn(prefill_rows, 576)
    out.append({"format": fmt, "rows": prefill_rows,
                "prefill_3072x576_ms": _median_ms(lambda: big(xp), max(3, repeats // 3))})
    return out


def run(formats: list[str], threads: list[int], rows: list[int], prefill_rows: int, layers: int,
        repeats: int) -> dict[str, Any]:
    before = torch.get_num_threads()
    out = []
    try:
        for th in threads:
            torch.set_num_threads(th)
            for fmt in formats:
                out += [{"threads": th, **r} for r in _one_format(fmt, rows, prefill_rows, layers, repeats)]
    finally:
        torch.set_num_threads(before)
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    return {"bench": "weight-kernels", "layers": layers, "load_average_end": load, "results": out}


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("weight-kernels")
    def weight_kernels(
        json_path: Annotated[str | None, typer.Option("--json", help="Where to write the JSON results.")] = None,
        formats: Annotated[str, typer.Option(help=f"Comma-separated: {','.join(FORMATS)}.")]
        = "fp32,bf16,int4,int8",
        threads: Annotated[str, typer.Option(help="Comma-separated torch thread counts.")] = "1,2",
        rows: Annotated[str, typer.Option(help="Comma-separated decode row counts.")] = "1,4,16",
        prefill_rows: Annotated[int, typer.Option(help="Rows of the prefill-shaped matmul.")] = 1024,
        layers: Annotated[int, typer.Option(help="Layers of distinct weights per decode step.")] = 30,
        repeats: Annotated[int, typer.Option(help="Timed repeats (median).")] = 10,
    ) -> None:
        """Decode-step and prefill matmul time per weight format and thread count."""
        data = run(formats.split(","), [int(t) for t in threads.split(",")], [int(r) for r in rows.split(",")],
                   prefill_rows, layers, repeats)
        table = Table(title=f"Weight kernels: {layers} layers of SmolLM2-135M shapes + head; "
                            f"load average at the end {data['load_average_end']}")
        for col in ("threads", "format", "rows", "layers ms", "head ms", "prefill 3072x576 ms"):
            table.add_column(col)
        for r in data["results"]:
            table.add_row(str(r["threads"]), r["format"], str(r["rows"]), f"{r.get('layers_ms', 0):.2f}",
                          f"{r.get('head_ms', 0):.2f}", f"{r.get('prefill_3072x576_ms', 0):.2f}")
        Console().print(table)
        print(f"wrote {write_json(data, json_path, 'weight_kernels.json')}")
