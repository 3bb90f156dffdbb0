"""Load one GGUF as `hafiza bench weights`' worker does (imports first, then `load_model` on the clock) and print
wall seconds, CPU seconds, the process's peak RSS and the load average; `--cache off|DIR` picks the weight cache.

`.venv/bin/python scripts/weights_load.py MODEL [--weights auto] [--cache off]`
"""

from __future__ import annotations

import argparse
import os
import resource
import time


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--cache", default=None, help="off, or the cache directory (default: the user cache)")
    args = ap.parse_args()
    if args.cache is not None:
        os.environ["HAFIZA_WEIGHTS_CACHE"] = args.cache
    t0 = time.perf_counter()
    from hafiza.engine import LLMEngine  # noqa: F401 (imported before the clock, as the bench worker does)
    from hafiza.models import load_model

    imports = time.perf_counter() - t0
    c0, t0 = cpu_s(), time.perf_counter()
    load_model(args.model, device="cpu", weights=args.weights)
    load, cpu = time.perf_counter() - t0, cpu_s() - c0
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    with open("/proc/loadavg") as f:
        avg = f.read().split()[0]
    print(f"imports {imports:.2f} s, load {load:.2f} s ({cpu:.2f} CPU s), peak RSS {hwm / 2**30:.3f} GiB, "
          f"load average {avg}")


if __name__ == "__main__":
    main()
