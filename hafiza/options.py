"""Options that more than one command takes (`hafiza serve`, `generate` and the benchmarks), declared once so
their names and help stay the same. A neutral module: the CLI and bench/ both import it, and it imports neither."""

from __future__ import annotations

from typing import Annotated

import typer

KvDtype = Annotated[str, typer.Option(
    help="KV pool format: auto (bf16), model, fp32, bf16, fp16, or lossy fp8, int8, int4.")]
Eviction = Annotated[str | None, typer.Option(
    help="Token eviction beyond --kv-budget-tokens: streaming (sinks + recent) or h2o (heavy hitters).")]
KvBudgetTokens = Annotated[int | None, typer.Option(help="With --eviction: most KV tokens one sequence keeps.")]
Weights = Annotated[str, typer.Option(
    help="Weight format: auto (the file's: GGUF 4-bit -> int4, Q5/Q6/Q8 -> int8), q4, q8, bf16, or fp32 (exact).")]
