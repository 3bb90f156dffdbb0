"""Registers every benchmark module's command on `hafiza bench`."""

from __future__ import annotations

import importlib

from hafiza.cli import bench_app

BENCH_MODULES = ("cache", "capacity", "engine_benches", "grammar", "native", "predictor", "quality", "serve", "tiers",
                 "suite", "weights", "weights_quality", "weight_kernels")

for _name in BENCH_MODULES:
    try:
        _module = importlib.import_module(f"hafiza.bench.{_name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"hafiza.bench.{_name}":
            raise
        continue
    _module.register(bench_app)
