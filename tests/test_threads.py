"""The thread policy: OpenMP defaults that respect the user, the load reading, the choice of threads (with a real
spinning process), and logits bit-identical whatever thread count the policy picks."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hafiza import threads
from hafiza.models import LoadedModel, load_model
from tests.models.test_logits_match_transformers import paged_logits


def test_openmp_defaults_fill_in_only_what_the_user_left_unset() -> None:
    env: dict[str, str] = {"PATH": "/bin"}
    assert threads.openmp_defaults(env) == {"GOMP_SPINCOUNT": "10000"}
    assert env["GOMP_SPINCOUNT"] == "10000" and "OMP_WAIT_POLICY" not in env
    assert threads.user_environment(env) == {"PATH": "/bin"}
    assert threads.openmp_defaults(env) == {}  # a child process inherits them unchanged
    for user in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "1000"}):
        env = dict(user)
        assert threads.openmp_defaults(env) == {} and env == user
        assert threads.user_environment(env) == user


# Records GOMP_SPINCOUNT at the moment torch is first imported, then runs the CLI's entry point.
WATCH_TORCH = """
import os, sys
seen = []
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("GOMP_SPINCOUNT"))
sys.meta_path.insert(0, Watch())
sys.argv = ["hafiza", *sys.argv[1:]]
from hafiza.cli import main
try:
    main()
except SystemExit:
    pass
print(seen, file=sys.stderr)
"""


def test_the_cli_process_starts_with_the_defaults() -> None:
    env = threads.user_environment()
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("GOMP_SPINCOUNT", None)
    out = subprocess.run([sys.executable, "-c", WATCH_TORCH, "memory", "--help"], capture_output=True, text=True,
                         env=env, check=True)
    assert out.stderr.strip().splitlines()[-1] == "['10000']"  # set before torch loaded


def test_importing_hafiza_changes_nothing_in_the_process() -> None:
    code = ("import os, threading\nbefore, threads = dict(os.environ), threading.active_count()\n"
            "import hafiza, hafiza.cli, hafiza.server.app, hafiza.server.offload, hafiza.engine\n"
            "print(dict(os.environ) == before, threading.active_count() == threads)")
    env = threads.user_environment()
    env.pop("OMP_WAIT_POLICY", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["True", "True"]


def test_read_times_sums_the_allowed_cpus(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  9 9 9 9 9 9 9 9 0 0\n"
                    "cpu0 100 1 10 500 7 2 3 4 0 0\n"
                    "cpu1 200 0 20 400 0 0 0 0 0 0\n"
                    "cpu2 999 0 0 0 0 0 0 0 0 0\n")
    t = threads.read_times([0, 1], str(stat))
    assert t.busy_s == pytest.approx((100 + 1 + 10 + 2 + 3 + 4 + 200 + 20) * threads.TICK_S)
    assert threads.read_times([0], str(tmp_path / "missing")).busy_s is None


def test_others_busy_subtracts_own_time() -> None:
    a, b = threads.CpuTimes(10.0, 1.0, 100.0), threads.CpuTimes(12.0, 1.5, 101.0)
    assert threads.others_busy(a, b) == pytest.approx(1.5)
    assert threads.others_busy(threads.CpuTimes(None, 0, 0), b) is None


@pytest.mark.parametrize(("maximum", "current", "other", "want"), [
    (2, 2, 0.0, 2), (2, 2, 0.4, 2), (2, 2, 0.6, 1), (2, 1, 0.4, 1), (2, 1, 0.2, 2), (2, 1, 1.9, 1),
    (8, 8, 0.0, 8), (8, 8, 2.6, 5), (8, 5, 2.4, 5), (8, 5, 2.1, 6), (8, 8, 7.9, 1), (8, 8, 20.0, 1),
])
def test_choose_threads_with_hysteresis(maximum: int, current: int, other: float, want: int) -> None:
    assert threads.choose_threads(current, maximum, other) == want


def test_policy_leaves_a_core_to_a_spinning_process() -> None:
    cpus = threads.allowed_cpus()
    if len(cpus) < 2:
        pytest.skip("one CPU: nothing to leave")
    policy = threads.ThreadPolicy(len(cpus), cpus)
    if not policy.enabled:
        pytest.skip("no /proc/stat here")
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        deadline = time.monotonic() + 30
        while policy.update() == len(cpus) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert policy.current < len(cpus), "the policy kept every core while another process spun on one"
    finally:
        spinner.kill()
        spinner.wait()


def test_a_thread_count_set_by_the_user_is_the_ceiling() -> None:
    before = torch.get_num_threads()
    try:
        threads.adapt()
        torch.set_num_threads(1)
        assert threads.adapt() == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
        threads.adapt()


@pytest.fixture(scope="module")
def quantized_model() -> LoadedModel:
    return load_model(device="cpu")


@pytest.mark.parametrize("which", ["fp32", "quantized"])
def test_logits_are_bit_identical_across_thread_counts(which: str, default_model: LoadedModel,
                                                       request: pytest.FixtureRequest) -> None:
    lm = default_model if which == "fp32" else request.getfixturevalue("quantized_model")
    prompt = lm.tokenizer.encode("The capital of France is Paris, and the capital of Germany is")
    before, was = torch.get_num_threads(), threads.is_adaptive()
    threads.set_adaptive(False)
    try:
        runs = []
        for n in (2, 1, 3):
            torch.set_num_threads(n)
            runs.append(paged_logits(lm, prompt, 4))
    finally:
        threads.set_adaptive(was)
        torch.set_num_threads(before)
    for n, run in zip((1, 3), runs[1:], strict=True):
        for step, (a, b) in enumerate(zip(runs[0], run, strict=True)):
            assert torch.equal(a, b), f"{which}: step {step} differs between 2 and {n} threads"
