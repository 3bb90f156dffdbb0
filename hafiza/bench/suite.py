"""`hafiza bench all`: run every benchmark (each in its own process), then write docs/BENCHMARKS.md regions and plots.

Each benchmark is a `hafiza …` command with `--json`; a failing or timed-out one is reported as such in its
region (with the last lines of its log) and the suite goes on. Peers run inside the benchmarks themselves
(transformers in `bench cache` and `bench quality`, llama.cpp in `bench llamacpp`), interleaved with hafiza.
The llama.cpp figures are also put next to hafiza's in the cache, prefix and serve regions. `--quick` shrinks every
benchmark to a smoke run (the figures are then not meaningful, and the regions say so).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer

from hafiza.bench import llamacpp
from hafiza.bench.common import RESULTS_DIR, machine
from hafiza.bench.markdown import Region, replace_region
from hafiza.bench.suite_render import RENDERERS, Context
from hafiza.errors import HafizaError


@dataclass(frozen=True)
class Bench:
    """One benchmark of the suite: its command (after `hafiza`), the quick variant's extra options, its region."""

    name: str
    command: tuple[str, ...]
    full: tuple[str, ...]
    quick: tuple[str, ...]
    region: Region
    plot_option: bool = False

    def argv(self, json_path: Path, plot_path: Path, quick: bool) -> list[str]:
        plot = ["--plot", str(plot_path)] if self.plot_option else []
        return [*self.command, "--json", str(json_path), *plot, *(self.quick if quick else self.full)]


ENGINE = Region("cache", "Engine core: KV cache vs recompute")
BENCHES: tuple[Bench, ...] = (
    Bench("cache", ("bench", "cache"), (), ("--contexts", "64", "--repeats", "1"), ENGINE),
    Bench("prefix", ("bench", "prefix"), (), ("--system-tokens", "160", "--repeats", "1"),
          Region("prefix", "Prefix caching, batching and memory")),
    Bench("batch", ("bench", "batch"), (), ("--streams", "1,2", "--new-tokens", "8"),
          Region("batch", "Prefix caching, batching and memory")),
    Bench("memory", ("bench", "memory"), (), ("--requests", "6", "--max-len", "256"),
          Region("memory", "Prefix caching, batching and memory")),
    Bench("serve", ("bench", "serve"), (),
          ("--sessions", "2", "--turns", "1", "--max-tokens", "4", "--system-words", "60"),
          Region("serve", "Server")),
    Bench("codec", ("codec", "bench"), ("--tokens", "1024"),
          ("--tokens", "32", "--coders", "raw,zstd,exponent", "--no-quantized"),
          Region("codec", "Lossless KV codec"), plot_option=True),
    Bench("tiers", ("bench", "tiers"), ("--tokens", "1024", "--repeats", "3"),
          ("--tokens", "64", "--repeats", "1", "--codecs", "raw,zstd"), Region("tiers", "Tiered KV store")),
    Bench("quality", ("bench", "quality"), ("--tokens", "1024", "--points", "2", "--gen", "32", "--budget", "256"),
          ("--tokens", "96", "--points", "1", "--gen", "4", "--formats", "bf16,int8", "--policies", "streaming",
           "--budget", "64", "--no-peer"), Region("quality", "Lossy KV formats and eviction"), plot_option=True),
    Bench("llamacpp", ("bench", "llamacpp"), ("--servers", "both"), llamacpp.QUICK_ARGS,
          Region("llamacpp", "The suite and the llama.cpp peer")),
)
SUMMARY = Region("summary", "The suite and the llama.cpp peer")
FULL_TIMEOUT_S, QUICK_TIMEOUT_S = 1800.0, 600.0


@dataclass
class Outcome:
    """How one benchmark run went."""

    bench: Bench
    argv: list[str]
    json_path: Path
    log_path: Path
    seconds: float = 0.0
    returncode: int | None = None
    timed_out: bool = False
    data: dict[str, Any] | None = None
    log_tail: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.data is not None

    @property
    def command(self) -> str:
        return "hafiza " + " ".join(self.argv)

    def failure(self) -> str:
        """One line on why there are no figures."""
        if self.timed_out:
            why = f"timed out after {self.seconds:.0f} s"
        elif self.returncode != 0:
            why = f"exit status {self.returncode}"
        else:
            why = "no JSON written"
        last = next((ln for ln in reversed(self.log_tail) if ln.strip()), "")
        return f"{why}" + (f": `{last.strip()[:200]}`" if last else "")


def conditions() -> str:
    """The load when the suite starts, and OpenMP's wait policy (hafiza sets its own, hafiza/threads.py)."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    from hafiza.threads import user_environment

    user = user_environment()
    policy = user.get("OMP_WAIT_POLICY") or os.environ.get("OMP_WAIT_POLICY", "unset")
    if "OMP_WAIT_POLICY" not in user and policy != "unset":
        policy += " (hafiza's default)"
    return f"load average {load:.1f} on {cores} cores, OMP_WAIT_POLICY={policy}"


def run_one(bench: Bench, json_dir: Path, docs: Path, quick: bool, timeout_s: float,
            python: str = sys.executable, echo: Callable[[str], None] = print,
            env: dict[str, str] | None = None) -> Outcome:
    """Run one benchmark as `python -m hafiza …` (in its own process group, so a timeout also stops the servers it
    started), teeing its output to DIR/NAME.log; never raises for its failures."""
    json_path, log_path = json_dir / f"{bench.name}.json", json_dir / f"{bench.name}.log"
    json_path.unlink(missing_ok=True)
    out = Outcome(bench, bench.argv(json_path, docs / f"bench_{bench.name}.png", quick), json_path, log_path)
    echo(f"== {out.command}")
    t0 = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen([python, "-u", "-m", "hafiza", *out.argv], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace", env=env,
                                start_new_session=True)
        timer = threading.Timer(timeout_s, _kill, (proc, out))
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                echo(line.rstrip("\n"))
                out.log_tail = [*out.log_tail[-19:], line]
            out.returncode = proc.wait()
        finally:
            timer.cancel()
    out.seconds = time.perf_counter() - t0
    if out.returncode == 0 and json_path.exists():
        try:
            out.data = json.loads(json_path.read_text())
        except json.JSONDecodeError as exc:
            out.log_tail.append(f"unreadable JSON: {exc}")
    echo(f"== {bench.name}: " + (f"ok ({out.seconds:.0f} s)" if out.ok else out.failure()))
    return out


def _kill(proc: subprocess.Popen, out: Outcome) -> None:
    out.timed_out = True
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


@dataclass
class Run:
    """One `bench all` invocation: what ran, how, under which conditions; saved as DIR/suite.json."""

    outcomes: list[Outcome]
    quick: bool
    invocation: str
    conditions: str
    date: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M %Z"))

    def save(self, json_dir: Path) -> Path:
        path = json_dir / "suite.json"
        path.write_text(json.dumps({
            "quick": self.quick, "invocation": self.invocation, "conditions": self.conditions, "date": self.date,
            "machine": machine(),
            "runs": [{"name": o.bench.name, "argv": o.argv, "seconds": o.seconds, "returncode": o.returncode,
                      "timed_out": o.timed_out, "log_tail": o.log_tail} for o in self.outcomes]}, indent=1))
        return path

    @classmethod
    def load(cls, json_dir: Path) -> Run:
        """The last run recorded in DIR/suite.json, each benchmark's JSON read back from DIR."""
        path = json_dir / "suite.json"
        if not path.exists():
            raise HafizaError(f"no {path}: run `hafiza bench all` first (--render-only redraws its results)")
        saved = json.loads(path.read_text())
        benches = {b.name: b for b in BENCHES}
        outcomes = []
        for r in saved["runs"]:
            out = Outcome(benches[r["name"]], r["argv"], json_dir / f"{r['name']}.json", json_dir / f"{r['name']}.log",
                          r["seconds"], r["returncode"], r["timed_out"], log_tail=r["log_tail"])
            if out.returncode == 0 and out.json_path.exists():
                out.data = json.loads(out.json_path.read_text())
            outcomes.append(out)
        return cls(outcomes, saved["quick"], saved["invocation"], saved["conditions"], saved["date"])


def write_docs(outcomes: list[Outcome], docs: Path, quick: bool, invocation: str, conditions: str = "",
               date: str | None = None) -> Path:
    """Rewrite the regions of the benchmarks that ran (and the suite summary) in DOCS/BENCHMARKS.md."""
    path = docs / "BENCHMARKS.md"
    doc = path.read_text() if path.exists() else "# Benchmarks\n"
    ctx = Context({o.bench.name: o.data for o in outcomes if o.ok}, docs, quick, machine(),
                  date or time.strftime("%Y-%m-%d %H:%M %Z"), conditions)
    for o in outcomes:
        doc = replace_region(doc, o.bench.region, region_body(o, ctx))
    doc = replace_region(doc, SUMMARY, summary_body(outcomes, ctx, invocation))
    path.write_text(doc)
    return path


def region_body(o: Outcome, ctx: Context) -> str:
    """The header line (command, machine, date) and the benchmark's tables, or why it has none."""
    head = (f"_Generated by `hafiza bench all` on {ctx.date}: `{o.command}` ({o.seconds:.0f} s) on "
            f"{ctx.machine_line}{'; ' + ctx.conditions if ctx.conditions else ''}._")
    if ctx.quick:
        head += "\n\n_Quick smoke run (`--quick`): these figures only show that the benchmark runs._"
    if not o.ok:
        return f"{head}\n\n**Did not run**: {o.failure()} (log: `{o.log_path}`)."
    render = RENDERERS.get(o.bench.name)
    try:
        body = render(o.data, ctx) if render else ctx.generic(o.data)
    except Exception as exc:  # a benchmark's JSON changed shape: show it raw rather than nothing
        body = f"_The table could not be drawn ({type(exc).__name__}: {exc}); raw JSON: `{o.json_path}`._\n\n"
        body += ctx.generic(o.data or {})
    return f"{head}\n\n{body}"


def summary_body(outcomes: list[Outcome], ctx: Context, invocation: str) -> str:
    from hafiza.bench.markdown import table

    rows = [[o.bench.name, "ok" if o.ok else "**failed**: " + o.failure(), f"{o.seconds:.0f}", f"`{o.command}`"]
            for o in outcomes]
    return (f"_Last `{invocation}`: {ctx.date} on {ctx.machine_line}"
            f"{'; ' + ctx.conditions if ctx.conditions else ''}._\n\n"
            + table(["benchmark", "result", "seconds", "command"], rows))


def register(bench_app: typer.Typer) -> None:
    """Add `hafiza bench all` (and `hafiza bench llamacpp`)."""
    llamacpp.register(bench_app)

    @bench_app.command("all")
    def bench_all(
        json_dir: Annotated[Path, typer.Option(help="Where each benchmark's JSON and log go.")] = RESULTS_DIR,
        docs: Annotated[Path, typer.Option(help="Where BENCHMARKS.md and the PNG plots go.")] = Path("docs"),
        quick: Annotated[bool, typer.Option("--quick", help="Shrink every benchmark to a smoke run.")] = False,
        only: Annotated[str | None, typer.Option(help="Comma-separated benchmarks to run (default: all).")] = None,
        skip: Annotated[str | None, typer.Option(help="Comma-separated benchmarks to leave out.")] = None,
        timeout: Annotated[float | None, typer.Option(help="Seconds per benchmark before it is stopped "
                                                            "(default 1800, 600 with --quick).")] = None,
        render_only: Annotated[bool, typer.Option("--render-only", help="Run nothing: redraw the docs from the "
                                                                          "last run's results in --json-dir.")
                               ] = False,
    ) -> None:
        """Every benchmark with its peers, then docs/BENCHMARKS.md tables and PNG plots."""
        if render_only:
            run = Run.load(json_dir)
            path = write_docs(run.outcomes, docs, run.quick, run.invocation, run.conditions, run.date)
            print(f"wrote {path} from the results of `{run.invocation}` ({run.date})")
            return
        names = [b.name for b in BENCHES]
        chosen = [s.strip() for s in only.split(",")] if only else names
        left_out = {s.strip() for s in skip.split(",")} if skip else set()
        unknown = [n for n in [*chosen, *left_out] if n not in names]
        if unknown:
            raise HafizaError(f"unknown benchmark(s) {', '.join(unknown)}: choose from {', '.join(names)}")
        json_dir.mkdir(parents=True, exist_ok=True)
        docs.mkdir(parents=True, exist_ok=True)
        limit = timeout or (QUICK_TIMEOUT_S if quick else FULL_TIMEOUT_S)
        started = conditions()
        print(f"== conditions: {started}")
        outcomes = [run_one(b, json_dir, docs, quick, limit) for b in BENCHES if b.name in chosen
                    and b.name not in left_out]
        invocation = "hafiza bench all " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "all"] else \
            "hafiza bench all"
        run = Run(outcomes, quick, invocation.strip(), started)
        run.save(json_dir)
        path = write_docs(outcomes, docs, quick, run.invocation, started, run.date)
        failed = [o.bench.name for o in outcomes if not o.ok]
        print(f"wrote {path} ({len(outcomes) - len(failed)} of {len(outcomes)} benchmarks ran"
              + (f"; failed: {', '.join(failed)}" if failed else "") + ")")
