"""Every `HAFIZA_*` environment variable hafiza reads: its name, type, default and meaning, in one place.

A setting is read when `read()` is called, never at import, so a test (monkeypatch.setenv) or a parent process
that sets one before a call is always seen. docs/ENGINE.md lists them; `ALL` is that list.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


def _flag(raw: str) -> bool:
    """`1` turns a switch on; anything else leaves it off (the variables' long-standing meaning)."""
    return raw == "1"


def _text(raw: str) -> str | None:
    """A string setting; empty means unset."""
    return raw or None


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One environment variable: `read()` returns it parsed, or `default` when it is unset."""

    name: str
    default: T
    parse: Callable[[str], T]
    doc: str

    def read(self, env: Mapping[str, str] | None = None) -> T:
        """The value in `env` (the process environment by default), parsed; `default` when the name is absent."""
        raw = (os.environ if env is None else env).get(self.name)
        return self.default if raw is None else self.parse(raw)

    def is_set(self, env: Mapping[str, str] | None = None) -> bool:
        """Whether the name is present in `env` at all, even empty."""
        return self.name in (os.environ if env is None else env)


ADAPTIVE_THREADS: Setting[bool] = Setting(
    "HAFIZA_ADAPTIVE_THREADS", True, _flag,
    "Before each CPU forward, use only the cores other processes leave free (hafiza/threads.py). On by default; "
    "any value but `1` turns it off.")
WEIGHTS_CACHE: Setting[str] = Setting(
    "HAFIZA_WEIGHTS_CACHE", "", str,
    "Directory of the repacked-GGUF weight cache, or `off` (also `0`, `no`, `false`) to disable it; unset: "
    "`$XDG_CACHE_HOME/hafiza/weights`, else `~/.cache/hafiza/weights`.")
LLAMA_SERVER: Setting[str | None] = Setting(
    "HAFIZA_LLAMA_SERVER", None, _text,
    "Path of the llama.cpp `llama-server` binary the benchmarks compare against (after `--llama-server`, before "
    "PATH).")
API_KEY: Setting[str | None] = Setting(
    "HAFIZA_API_KEY", None, _text,
    "`--api-key` for `hafiza serve` and `hafiza top` when the flag is not given.")
ADMIN_KEY: Setting[str | None] = Setting(
    "HAFIZA_ADMIN_KEY", None, _text,
    "`--admin-key` for `hafiza serve` when the flag is not given.")
OMP_DEFAULTS: Setting[str] = Setting(
    "HAFIZA_OMP_DEFAULTS", "", str,
    "Set by hafiza, not by users: the OpenMP variables hafiza chose itself (comma-separated), so child processes "
    "keep them and peers run without them. Present, even empty, means leave OpenMP's settings alone.")

CPU_KERNEL: Setting[str] = Setting(
    "HAFIZA_CPU_KERNEL", "auto", str,
    "Which kernels multiply a GGUF's quantized matmuls on the CPU: `ggml` (ggml's integer-dot kernels on the "
    "file's own blocks; needs ggml-python, which `make setup` builds), `torch` (torch's packed int4/int8 kernels) "
    "or `auto` (torch's, for now: docs/WEIGHTS.md says why).")

GATE_DIR: Setting[str] = Setting(
    "HAFIZA_GATE_DIR", "", str,
    "Directory of the host-wide serving gate, through which every hafiza instance on the host keeps its "
    "speculative encodes out of the others' requests, or `off` (also `0`, `no`, `false`) for a per-process gate; "
    "unset: `/dev/shm/hafiza-gate-<uid>`, else `$XDG_RUNTIME_DIR/hafiza-gate`, else the temp directory.")

ALL: tuple[Setting, ...] = (ADAPTIVE_THREADS, WEIGHTS_CACHE, LLAMA_SERVER, API_KEY, ADMIN_KEY, OMP_DEFAULTS,
                            CPU_KERNEL, GATE_DIR)
