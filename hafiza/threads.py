"""CPU threads for the forward: how OpenMP waits, how many intra-op threads each step uses, and the fixed split of
the decode matmul, so that decode keeps its speed when other processes take cores and values never depend on it.

- `openmp_defaults()` runs before torch is imported, at each entry point (`hafiza.cli.main`, the benchmark worker,
  tests/conftest.py), never on import. A waiting OpenMP thread spins about 10,000 rounds (tens of microseconds),
  then sleeps. That covers the gaps between one decode step's ops, so a step never pays a sleeping thread's
  wake-up (on a 2-core VM a passive wait made 2 threads slower than 1). And a thread whose sibling was
  descheduled does not hold its core for long (libgomp's default spins 300,000 rounds) (docs/BENCHMARKS.md).
- `adapt()` runs before each forward on the CPU (LlamaModel.forward). With settings.ADAPTIVE_THREADS on (the
  default) it reads how busy the allowed cores were since the last look (/proc/stat, less this process's own CPU
  time) and uses only the cores left free, so that a core another process takes is not waited for at every
  barrier.
- `decode_parts()`: how many slices the decode matmul splits its weight into; fixed for the process (the thread
  count it started with), never the thread count of the moment, so logits are bit-identical whatever `adapt()` picks.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from hafiza import settings

WAIT_DEFAULTS = {"GOMP_SPINCOUNT": "10000"}
SAMPLE_S = 0.25  # shortest window over which the other processes' load is measured
BUSY_DROP, BUSY_RAISE = 0.5, 0.25  # a core counts as taken above BUSY_DROP, as free again below BUSY_RAISE


def openmp_defaults(env: dict[str, str] | os._Environ = os.environ) -> dict[str, str]:
    """Set OpenMP's wait policy in `env` unless the user chose one (any OMP_WAIT_POLICY or GOMP_SPINCOUNT);
    returns what was set. Only effective before torch (and with it libgomp) is loaded."""
    if any(k in env for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")) or settings.OMP_DEFAULTS.is_set(env):
        return {}
    env.update(WAIT_DEFAULTS)
    env[settings.OMP_DEFAULTS.name] = ",".join(WAIT_DEFAULTS)  # children know these were not the user's choice
    return dict(WAIT_DEFAULTS)


def user_environment(env: dict[str, str] | os._Environ = os.environ) -> dict[str, str]:
    """A copy of `env` without what `openmp_defaults` added: for peers (llama.cpp) that must run as the user would."""
    out = dict(env)
    for name in out.pop(settings.OMP_DEFAULTS.name, "").split(","):
        out.pop(name, None)
    return out


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


@dataclass
class CpuTimes:
    """Busy seconds summed over `cpus` (None where /proc/stat is unreadable), this process's CPU seconds, wall."""

    busy_s: float | None
    own_s: float
    wall_s: float


TICK_S = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


def read_times(cpus: list[int], stat_path: str = "/proc/stat") -> CpuTimes:
    """Busy time (user, nice, system, irq, softirq, steal) of `cpus` and this process's own CPU time, now."""
    own, wall = time.process_time(), time.monotonic()
    try:
        with open(stat_path) as f:
            lines = f.read().splitlines()
    except OSError:
        return CpuTimes(None, own, wall)
    wanted = {f"cpu{c}" for c in cpus}
    busy = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name in wanted:
            v = [int(x) for x in rest.split()]
            busy += v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)
    return CpuTimes(busy * TICK_S, own, wall)


def others_busy(before: CpuTimes, after: CpuTimes) -> float | None:
    """Cores' worth of CPU that other processes (and the hypervisor, as steal) used between two readings."""
    if before.busy_s is None or after.busy_s is None or after.wall_s <= before.wall_s:
        return None
    other = (after.busy_s - before.busy_s) - (after.own_s - before.own_s)
    return max(0.0, other / (after.wall_s - before.wall_s))


def choose_threads(current: int, maximum: int, other: float) -> int:
    """Threads for the next steps: the cores not taken by others, with hysteresis so that a load hovering at a
    threshold does not flip the count every window."""
    taken_high = int(other + 1 - BUSY_DROP)  # cores surely taken: `other` past k - 1 + BUSY_DROP takes k
    taken_low = int(other + 1 - BUSY_RAISE)  # below k - 1 + BUSY_RAISE at most k - 1 are taken
    lo, hi = max(1, maximum - taken_low), max(1, maximum - taken_high)
    if current > hi:
        return hi
    if current < lo:
        return lo
    return min(max(current, 1), maximum)


class ThreadPolicy:
    """Chooses the intra-op thread count of the thread that runs the forward, step by step."""

    def __init__(self, maximum: int, cpus: list[int], adaptive: bool = True, stat_path: str = "/proc/stat") -> None:
        """`adaptive` False keeps `maximum` threads whatever the load (settings.ADAPTIVE_THREADS=0)."""
        self.maximum, self.cpus, self.stat_path = maximum, cpus, stat_path
        self.current = maximum
        self.last = read_times(cpus, stat_path)
        self.enabled = adaptive and self.last.busy_s is not None

    def update(self, now: CpuTimes | None = None) -> int:
        """The thread count for the next step: re-chosen once per SAMPLE_S window."""
        if not self.enabled:
            return self.current
        now = now or read_times(self.cpus, self.stat_path)
        if now.wall_s - self.last.wall_s < SAMPLE_S:
            return self.current
        other = others_busy(self.last, now)
        self.last = now
        if other is not None:
            self.current = choose_threads(self.current, self.maximum, other)
        return self.current


_lock = threading.Lock()
_policy: ThreadPolicy | None = None
_parts: int | None = None
_applied = threading.local()


def _start() -> ThreadPolicy:
    global _policy, _parts
    with _lock:
        if _policy is None:
            import torch

            cpus = allowed_cpus()
            _parts = _parts or max(1, min(torch.get_num_threads(), len(cpus)))
            maximum = len(cpus)  # each thread's own count caps it (adapt)
            _policy = ThreadPolicy(maximum, cpus, adaptive=settings.ADAPTIVE_THREADS.read())
        return _policy


def set_adaptive(enabled: bool) -> None:
    """Turn the load-following thread count on or off for the process (off: the thread count set stays)."""
    policy = _start()
    with _lock:
        policy.enabled = enabled and policy.last.busy_s is not None
        policy.current = policy.maximum


def is_adaptive() -> bool:
    """Whether the thread count follows the other processes' load."""
    return _start().enabled


def decode_parts() -> int:
    """Slices of the decode matmul: the thread count the process started with, fixed from its first forward."""
    global _parts
    if _parts is None:
        import torch

        with _lock:
            _parts = _parts or max(1, min(torch.get_num_threads(), len(allowed_cpus())))
    return _parts


def adapt() -> int:
    """Set this thread's torch intra-op threads for the next step (see ThreadPolicy); returns the count used.
    The count this thread had at its first call, or that someone set since (torch.set_num_threads), is its ceiling."""
    import torch

    policy = _start()
    have = torch.get_num_threads()
    if getattr(_applied, "n", None) != have:
        _applied.ceiling = max(1, min(have, policy.maximum))
    with _lock:
        want = min(policy.update(), _applied.ceiling)
    if want != have:
        torch.set_num_threads(want)
    _applied.n = want
    return want
