"""Starting a cluster on this machine: redis-server, N `hafiza serve` workers publishing KV events, and
vllm-router in front of them, all on loopback (shared by `hafiza cluster` and `hafiza bench cluster`)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from hafiza.errors import HafizaError

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port nothing listens on now, on loopback."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Worker:
    """One `hafiza serve` instance: its HTTP port, its KV event PUB and replay ports."""

    port: int
    events: int
    replay: int

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def command(self, redis_url: str, extra: list[str]) -> list[str]:
        return [sys.executable, "-m", "hafiza", "serve", "--host", HOST, "--port", str(self.port),
                "--kv-events", f"tcp://{HOST}:{self.events}", "--kv-events-replay", f"tcp://{HOST}:{self.replay}",
                "--store-redis", redis_url, *extra]


@dataclass(frozen=True)
class Layout:
    """Ports and commands of one cluster on this machine."""

    workers: tuple[Worker, ...]
    redis_port: int
    router_port: int
    policy: str = "kv_aware"
    model_name: str = "hafiza"
    worker_args: tuple[str, ...] = field(default=())

    @classmethod
    def on_free_ports(cls, n: int, policy: str = "kv_aware", worker_args: tuple[str, ...] = ()) -> Layout:
        workers = tuple(Worker(free_port(), free_port(), free_port()) for _ in range(n))
        return cls(workers, free_port(), free_port(), policy, worker_args=worker_args)

    @property
    def redis_url(self) -> str:
        return f"redis://{HOST}:{self.redis_port}"

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.router_port}"

    def redis_command(self, directory: Path) -> list[str]:
        return [redis_binary(), "--bind", HOST, "--port", str(self.redis_port), "--save", "", "--appendonly", "no",
                "--dir", str(directory)]

    def worker_commands(self) -> list[list[str]]:
        extra = ["--model-name", self.model_name, *self.worker_args]
        return [w.command(self.redis_url, extra) for w in self.workers]

    def router_command(self) -> list[str]:
        cmd = [router_binary(), "--host", HOST, "--port", str(self.router_port), "--policy", self.policy,
               "--worker-urls", *(w.url for w in self.workers), "--prometheus-port", str(free_port())]
        if self.policy == "kv_aware":
            for w in self.workers:
                cmd += ["--kv-event-source", f"{w.url}=tcp://{HOST}:{w.events}",
                        "--kv-event-replay-source", f"{w.url}=tcp://{HOST}:{w.replay}"]
            cmd += ["--kv-event-block-size", "16", "--kv-event-model", self.model_name]
        return cmd


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        raise HafizaError("redis-server is not installed (scripts/system-deps.sh installs it)")
    return found


def router_binary() -> str:
    found = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    if not Path(found).exists():
        raise HafizaError("vllm-router is not installed (pip install vllm-router==0.1.17, a hafiza dependency)")
    return found


def worker_env() -> dict[str, str]:
    """One compute thread per worker: N workers share this machine's cores."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Return once `url`/health answers 200; raise if the process exits or `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise HafizaError(f"{' '.join(proc.args[:4])} exited with status {proc.returncode}")  # type: ignore[index]
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise HafizaError(f"{url} was not healthy within {timeout_s:.0f} s")


class Cluster:
    """The running processes of a `Layout`; `stop()` ends them, router first."""

    def __init__(self, layout: Layout, log_dir: Path) -> None:
        self.layout, self.log_dir = layout, log_dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 (the process owns it until it ends)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        self.procs.append(proc)
        return proc

    def start(self, timeout_s: float = 300.0) -> Cluster:
        lay = self.layout
        try:
            self._spawn("redis", lay.redis_command(self.log_dir))
            workers = [self._spawn(f"worker{i}", cmd, worker_env()) for i, cmd in enumerate(lay.worker_commands())]
            for w, proc in zip(lay.workers, workers, strict=True):
                wait_healthy(w.url, proc, timeout_s)
            router = self._spawn("router", lay.router_command())
            wait_healthy(lay.url, router, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in reversed(self.procs):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
