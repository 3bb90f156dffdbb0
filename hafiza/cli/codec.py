"""`hafiza codec bench | inspect`: measure the lossless KV codec, or show what a container holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from hafiza.cli import app
from hafiza.errors import HafizaError

codec_app = typer.Typer(no_args_is_help=True, help="Lossless KV codec: benchmark it, inspect containers.")
app.add_typer(codec_app, name="codec")


@codec_app.command("bench")
def bench(
    text: Annotated[list[Path] | None, typer.Option("--text", help="Text file (repeatable)")] = None,
    tokens: Annotated[int, typer.Option("--tokens", help="Tokens of each text to capture KV for")] = 2048,
    coders: Annotated[str, typer.Option("--coders", help="Comma-separated coders and peers, or 'all'")] = "all",
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the results here")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a Pareto PNG (bits/value vs decode MB/s)")] = None,
    quantized: Annotated[bool, typer.Option(help="Also code fp8- and int8-quantised KV")] = True,
    grid: Annotated[int, typer.Option("--grid", help="Round speculative predictions to this many steps")] = 1,
) -> None:
    """Capture the default model's KV over real texts and code it with every coder and peer (one thread)."""
    from hafiza.bench.codec.plot import pareto_plot
    from hafiza.bench.codec.runner import ALL, default_texts, run

    texts = text or default_texts()
    if not texts:
        raise HafizaError("no texts: pass --text FILE (bench/texts/ is empty or missing)")
    if tokens < 2:
        raise HafizaError("--tokens must be at least 2")
    names = ALL if coders == "all" else [c.strip() for c in coders.split(",") if c.strip()]
    if grid < 1:
        raise HafizaError("--grid must be at least 1")
    results = run(texts, tokens, names, quantized=quantized, grid=grid, progress=lambda s: typer.echo(s, err=True))
    _print_table(results)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(results, indent=1))
        typer.echo(f"wrote {json_path}")
    if plot:
        plot.parent.mkdir(parents=True, exist_ok=True)
        pareto_plot(results, plot)
        typer.echo(f"wrote {plot}")


def _print_table(results: dict) -> None:
    ent = results["entropy0"]
    for dname, h in ent.items():
        typer.echo(f"zero-order entropy {dname}: K {h['k']:.3f}  V {h['v']:.3f}  all {h['all']:.3f} bits/value")
    typer.echo(f"{'kv':8s} {'coder':45s} {'K':>7s} {'V':>7s} {'all':>7s} {'enc MB/s':>9s} {'dec MB/s':>9s} "
               f"{'pred cost':>9s} {'lossless':>8s}")
    for c in results["coders"]:
        cost = f"{c['predictor_cost']:.3f}" if "predictor_cost" in c else "-"
        typer.echo(f"{c['kv_dtype']:8s} {c['coder']:45s} {c['bits_k']:7.3f} {c['bits_v']:7.3f} "
                   f"{c['bits_per_value']:7.3f} {c['encode_MBps']:9.1f} {c['decode_MBps']:9.1f} {cost:>9s} "
                   f"{c['lossless']!s:>8s}")


@codec_app.command("inspect")
def inspect(file: Annotated[Path, typer.Argument(help="A hafiza KV container")]) -> None:
    """Show a container's header: dtype, shape, coder, predictor, chunks, sizes (framing is verified)."""
    from hafiza.codec.describe import describe

    if not file.is_file():
        raise HafizaError(f"file not found: {file}")
    for key, value in describe(file.read_bytes()).items():
        typer.echo(f"{key:28s} {value}")
