"""The host-wide serving gate: another process's serving holds this process's encodes back, a killed server
releases them, and the directory setting; asserted on the order of events, never on timings."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from hafiza.errors import ConfigError
from hafiza.store.gate import ServingGate
from hafiza.store.host_gate import HostGate, gate_dir, host_gate

SERVER = """
import sys
from pathlib import Path
from hafiza.store.host_gate import HostGate
gate = HostGate(Path(sys.argv[1]))
gate.hold()
print("held", flush=True)
sys.stdin.readline()
gate.release()
print("released", flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process on the host that is serving: it holds the gate until told to stop."""
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(tmp_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait(30)


def wait_until_parked(gate: ServingGate) -> None:
    """Block until the writer is waiting on the gate (it counted a wait)."""
    with gate._cond:
        while gate.waits == 0:
            gate._cond.wait(0.01)


def start_encode(gate: ServingGate, record: list[str]) -> threading.Thread:
    def writer() -> None:
        with gate.encoding():
            record.append("encode")

    t = threading.Thread(target=writer)
    t.start()
    return t


def test_another_processs_serving_holds_an_encode_back_until_it_goes_idle(
        tmp_path: Path, server: subprocess.Popen[str]) -> None:
    events: list[str] = ["child-serving"]
    gate = ServingGate(host=HostGate(tmp_path), recheck_s=0.01)
    assert not gate.busy  # this process is idle: only the other one serves
    t = start_encode(gate, events)
    wait_until_parked(gate)
    assert events == ["child-serving"]
    assert server.stdin is not None and server.stdout is not None
    server.stdin.write("\n")
    server.stdin.flush()
    assert server.stdout.readline().strip() == "released"
    events.append("child-released")
    t.join(30)
    assert events == ["child-serving", "child-released", "encode"]
    assert gate.waits == 1


def test_a_killed_server_releases_the_waiting_encode(tmp_path: Path, server: subprocess.Popen[str]) -> None:
    events: list[str] = []
    gate = ServingGate(host=HostGate(tmp_path), recheck_s=0.01)
    t = start_encode(gate, events)
    wait_until_parked(gate)
    server.kill()  # SIGKILL: no release, the kernel drops the lock with the process
    server.wait(30)
    events.append("killed")
    t.join(30)
    assert events == ["killed", "encode"]


def test_two_gates_in_one_process_share_the_host_state(tmp_path: Path) -> None:
    events: list[str] = []
    serving = ServingGate(host=HostGate(tmp_path))
    writing = ServingGate(host=HostGate(tmp_path), recheck_s=0.01)
    serving.serving(True)
    t = start_encode(writing, events)
    wait_until_parked(writing)
    events.append("idle")
    serving.serving(False)
    t.join(30)
    assert events == ["idle", "encode"]


def test_marks_see_another_instance_serving(tmp_path: Path) -> None:
    serving = ServingGate(host=HostGate(tmp_path))
    gate = ServingGate(host=HostGate(tmp_path))
    quiet = gate.marks()
    assert not ServingGate.overlapped(quiet, gate.marks(), "serve")
    serving.serving(True)
    serving.serving(False)  # a whole request between the two marks: the epoch moved
    assert ServingGate.overlapped(quiet, gate.marks(), "serve")
    serving.serving(True)
    now = gate.marks()
    assert now.host_busy and not now.busy
    serving.close()
    gate.close()


def test_the_gate_directory_setting(tmp_path: Path) -> None:
    assert gate_dir({"HAFIZA_GATE_DIR": "off"}) is None and host_gate({"HAFIZA_GATE_DIR": "0"}) is None
    named = tmp_path / "gate"
    assert gate_dir({"HAFIZA_GATE_DIR": str(named)}) == named and named.is_dir()
    assert (named.stat().st_mode & 0o777) == 0o700
    chosen = gate_dir({})
    assert chosen is not None and chosen.is_dir() and chosen.name.startswith("hafiza-gate")
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="HAFIZA_GATE_DIR") as err:
        gate_dir({"HAFIZA_GATE_DIR": str(blocker / "under")})
    assert err.value.setting == "HAFIZA_GATE_DIR"


def test_a_closed_gate_neither_holds_nor_blocks(tmp_path: Path) -> None:
    gate = ServingGate(host=HostGate(tmp_path))
    gate.close()
    gate.serving(True)
    other = HostGate(tmp_path)
    assert not other.busy()
    other.close()
