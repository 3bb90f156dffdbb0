"""Start real redis-server processes on free loopback ports for tests: one server, or a 3-master cluster.

Each server runs in its own directory with persistence off (`--save '' --appendonly no`), is ready once it
answers PING, and can be killed (SIGKILL, like a crash) and started again on the same port.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
CLUSTER_BUS_OFFSET = 10000


def redis_available() -> bool:
    """Whether redis-server and redis-cli are installed (Debian package `redis-server`)."""
    return Path(REDIS_SERVER).exists() and Path(REDIS_CLI).exists()


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster: bool = False) -> int:
    """A free loopback port; for a cluster node its bus port (+10000) must be free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not cluster or (port + CLUSTER_BUS_OFFSET < 65536 and _port_free(port + CLUSTER_BUS_OFFSET)):
            return port
    raise RuntimeError("no free loopback port found")


def _command(port: int, *args: str, timeout: float = 1.0) -> bytes | None:
    """Send one inline command and return the raw reply, or None when nothing answers."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall((" ".join(args) + "\r\n").encode())
            return s.recv(65536)
    except OSError:
        return None


class RedisServer:
    """One redis-server process owned by a test; `kill()` then `start()` reuses the port."""

    def __init__(self, workdir: Path, port: int | None = None, cluster: bool = False):
        self.cluster = cluster
        self.port = port or free_port(cluster)
        self.workdir = Path(workdir) / f"redis-{self.port}"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def argv(self) -> list[str]:
        args = [
            REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "no",
            "--logfile", str(self.workdir / "redis.log"), "--loglevel", "warning", "--daemonize", "no",
        ]  # fmt: skip
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", "2000"]  # fmt: skip
        return args

    def ping(self) -> bool:
        return (_command(self.port, "PING") or b"").startswith(b"+PONG")

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Launch and wait until the server answers PING."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.proc = subprocess.Popen(self.argv(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self.ping():
                return self
            time.sleep(0.01)
        self.stop()
        log = self.workdir / "redis.log"
        tail = log.read_text()[-2000:] if log.exists() else ""
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING:\n{tail}")

    def kill(self) -> None:
        """SIGKILL, like a crash; waits until the port stops answering."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        """SIGTERM and wait (SIGKILL after 5 s)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisClusterServers:
    """`n` cluster-enabled masters joined with `redis-cli --cluster create` (no replicas)."""

    def __init__(self, workdir: Path, n: int = 3):
        self.nodes = [RedisServer(workdir, cluster=True) for _ in range(n)]

    @property
    def url(self) -> str:
        """A startup node (the client discovers the others)."""
        return self.nodes[0].url

    def ready(self) -> bool:
        """Every node reports cluster_state:ok (all slots covered, nodes agree)."""
        return all(b"cluster_state:ok" in (_command(n.port, "CLUSTER", "INFO") or b"") for n in self.nodes)

    def start(self, timeout: float = 30.0) -> RedisClusterServers:
        try:
            for node in self.nodes:
                node.start()
            addrs = [f"127.0.0.1:{node.port}" for node in self.nodes]
            subprocess.run(
                [REDIS_CLI, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
                check=True, capture_output=True, timeout=timeout,
            )  # fmt: skip
            deadline = time.monotonic() + timeout
            while not self.ready():
                if time.monotonic() > deadline:
                    raise RuntimeError("redis cluster did not reach cluster_state:ok")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.stop()

    def __enter__(self) -> RedisClusterServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
