"""Shared benchmark plumbing: machine description, JSON output, medians."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import redis
import torch

RESULTS_DIR = Path("bench/results")


def machine() -> dict[str, Any]:
    """What the figures were measured on: CPU model, cores, torch threads, device."""
    cpu, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), cpu)
        flags = set(next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), []))
    except OSError:
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    info: dict[str, Any] = {"cpu": cpu, "cpu_isa": " ".join(isa), "cores": os.cpu_count(),
                            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                            "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def nearest_rank(values: list[float], q: float) -> float:
    """The q-quantile (0..1) as the nearest order statistic (no interpolation)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def write_json(data: dict[str, Any], path: str | Path | None, default_name: str) -> Path:
    """Write `data` (plus machine info and a timestamp) to `path` or bench/results/<default_name>."""
    out = Path(path) if path else RESULTS_DIR / default_name
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine(), "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), **data}
    out.write_text(json.dumps(payload, indent=2))
    return out


def wait_http(proc: subprocess.Popen, url: str, name: str, timeout_s: float = 600) -> None:
    """Poll `url` until it answers 200; fail with `name` as soon as the server process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with status {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{name} did not answer within {timeout_s:.0f} s")


@contextlib.contextmanager
def redis_process(exe: str, *options: str) -> Iterator[tuple[int, redis.Redis]]:
    """A throw-away redis-server (no persistence) on a free loopback port with extra `options`, once it answers
    PING: its port and a client, both closed after."""
    from hafiza.server.launch import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as workdir:
        proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                 "--dir", workdir, *options], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=port)
        try:
            deadline = time.monotonic() + 10
            while True:
                with contextlib.suppress(redis.ConnectionError):
                    if client.ping():
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.02)
            yield port, client
        finally:
            client.close()
            proc.terminate()
            proc.wait(10)
