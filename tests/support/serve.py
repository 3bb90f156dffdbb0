"""`python -m hafiza serve` as a real subprocess on a free loopback port, for the tests that need the CLI's own
start-up and shutdown (the in-process server of tests/server/conftest.py covers everything else), and the CLI run
in-process for refusals that end before any start-up."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import httpx
import pytest

from hafiza.cli import main
from hafiza.server.launch import free_port

ROOT = Path(__file__).resolve().parents[2]


class ServeProcess:
    """One `hafiza serve` process: its output goes to `log`; `wait_ready` polls /health until it answers."""

    def __init__(self, log: Path, *args: str, kv_memory: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        argv = [sys.executable, "-m", "hafiza", "serve", "--port", str(self.port), *args]
        if kv_memory is not None:
            argv += ["--kv-memory", kv_memory]
        self._out = log.open("w")
        self.proc = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT, cwd=ROOT)
        self.model = ""

    def wait_ready(self, timeout_s: float = 600.0, api_key: str | None = None) -> ServeProcess:
        """Wait until GET /health answers 200 (failing at once if the process exits); reads the served model id
        (with `api_key` when the server requires one)."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"hafiza serve exited:\n{self.output()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"hafiza serve did not come up in {timeout_s:g} s:\n{self.output()}"
            time.sleep(0.1)
        headers = {"x-api-key": api_key} if api_key else {}
        r = httpx.get(f"{self.url}/v1/models", headers=headers, timeout=10)
        assert r.status_code == 200, r.text
        self.model = r.json()["data"][0]["id"]
        return self

    def metric(self, name: str, **labels: str) -> float | None:
        """One sample from GET /metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return None

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout_s: float = 120.0) -> bool:
        """Send `sig` and wait (SIGKILL after `timeout_s`); True when it ended cleanly. A graceful shutdown flushes
        pending store writes; uvicorn re-raises SIGTERM once it is complete, so the status is 0 or -SIGTERM."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._out.close()
        return self.proc.returncode in (0, -signal.SIGTERM)

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def output(self) -> str:
        """Everything the process has written so far."""
        return self.log.read_text()

    def __enter__(self) -> ServeProcess:
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


@dataclass
class CliResult:
    """What `hafiza ARGS` did: its exit status and what it wrote."""

    returncode: int
    stdout: str
    stderr: str


def run_cli(args: Sequence[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> CliResult:
    """`hafiza ARGS` in this process, through the entry point `python -m hafiza` runs (`hafiza.cli.main`), without
    a fresh interpreter's seconds of imports. Any exception but SystemExit escapes and fails the test: that is the
    traceback a user would have seen (tests/server/test_cli.py keeps one refusal as a real process)."""
    monkeypatch.setattr(sys, "argv", ["hafiza", *args])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main()
    out = capsys.readouterr()
    code = exited.value.code
    status = 0 if code is None else code if isinstance(code, int) else 1  # sys.exit('text') is status 1
    return CliResult(status, out.out, out.err)
