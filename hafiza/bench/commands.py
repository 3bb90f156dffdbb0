"""`hafiza bench`: the group, with every benchmark module's command registered on it. The CLI adds the group to
`hafiza` (hafiza/cli); bench/ imports nothing from the CLI."""

from __future__ import annotations

import importlib

import typer

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: print a table, write JSON under bench/results/.")

BENCH_MODULES = ("cache", "capacity", "cluster", "engine_benches", "grammar", "native", "predictor", "quality", "serve",
                 "speculative", "tiers", "suite", "weights", "weights_quality", "weight_kernels")

for _name in BENCH_MODULES:
    try:
        _module = importlib.import_module(f"hafiza.bench.{_name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"hafiza.bench.{_name}":
            raise
        continue
    _module.register(bench_app)
