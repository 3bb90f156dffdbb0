"""Benchmarks (`hafiza bench …`): each prints a table and writes JSON under bench/results/."""
