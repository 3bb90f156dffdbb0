"""ServingGate: a speculative encode never starts while the engine serves, asserted on the order of events."""

from __future__ import annotations

import threading

from hafiza.store.gate import ServingGate


def test_an_encode_waits_for_the_engine_to_go_idle_and_never_runs_inside_a_prefill() -> None:
    events: list[str] = []
    lock = threading.Lock()

    def record(name: str) -> None:
        with lock:
            events.append(name)

    gate = ServingGate(on_event=record)
    gate.serving(True)  # a request's prefill is running
    record("prefill-start")
    queued = threading.Event()
    done = threading.Event()

    def writer() -> None:
        queued.set()
        with gate.encoding():
            record("encode-work")
        done.set()

    t = threading.Thread(target=writer)
    t.start()
    assert queued.wait(30)
    with gate._cond:  # the writer is parked on the gate's condition, not running
        while gate.waits == 0:
            gate._cond.wait(0.01)
    record("prefill-end")
    gate.serving(False)
    assert done.wait(30)
    t.join(30)
    assert events == ["serve", "prefill-start", "prefill-end", "idle", "encode", "encode-work", "encoded"]
    assert gate.waits == 1


def test_overlap_marks_say_which_side_competed() -> None:
    gate = ServingGate()
    before = gate.marks()
    with gate.encoding():
        pass
    after = gate.marks()
    assert ServingGate.overlapped(before, after, "encode") and not ServingGate.overlapped(before, after, "serve")
    quiet = gate.marks()
    assert not ServingGate.overlapped(quiet, gate.marks(), "encode")
    gate.serving(True)
    assert ServingGate.overlapped(quiet, gate.marks(), "serve")


def test_idle_check_releases_a_writer_when_the_engine_stopped_without_saying_so() -> None:
    stopped = threading.Event()
    gate = ServingGate(idle_check=stopped.is_set, recheck_s=0.01)
    gate.serving(True)
    done = threading.Event()

    def writer() -> None:
        gate.wait_idle()
        done.set()

    t = threading.Thread(target=writer)
    t.start()
    assert not done.is_set() and gate.busy
    stopped.set()  # e.g. the last request was aborted between steps
    assert done.wait(30)
    t.join(30)
    assert not gate.busy
