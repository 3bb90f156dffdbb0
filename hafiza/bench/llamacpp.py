"""`hafiza bench llamacpp`: llama.cpp (llama-cpp-python) on the same GGUF as hafiza, measured interleaved with it.

- prefill and decode: the same token ids as `bench cache` (64 greedy tokens after 128 and 1024 tokens of context);
- prompt cache: TTFT of a chat request after a long shared system prompt, cold vs warm (llama.cpp reuses the
  longest common prefix of its context; hafiza its prefix cache), same prompts as `bench prefix`;
- servers: llama.cpp's server (the `llama-server` binary with parallel slots when one is found, else
  `python -m llama_cpp.server`, which serves one request at a time) and `hafiza serve`, each under the same
  concurrent multi-turn chat load as `hafiza bench serve` (its load generator, OpenAI API).

llama-cpp-python is a benchmark peer, not a dependency (`pip install '.[peers]'`); when it is missing or fails,
the JSON says why and no number is made up.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer

from hafiza import settings
from hafiza.bench import serve as serve_bench
from hafiza.bench.common import wait_http, write_json
from hafiza.bench.llama_peer import llama_generate, llama_import, llama_ttft, open_llama
from hafiza.options import Weights
from hafiza.threads import user_environment

NEW_TOKENS = 64
QUICK_ARGS = ("--contexts", "64", "--repeats", "1", "--system-tokens", "160", "--sessions", "2", "--turns", "1",
              "--max-tokens", "4", "--system-words", "60")
SLOT_CONTEXT = 2048
WHERE_LLAMA_SERVER = f"--llama-server, ${settings.LLAMA_SERVER.name} or PATH"


def _median_runs(samples: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)


def bench_decode(llama_cpp: Any, loaded: Any, contexts: list[int], repeats: int, threads: int) -> list[dict]:
    """Prefill + 64 greedy tokens, llama.cpp and hafiza interleaved, per context length."""
    from hafiza.bench.cache import context_ids, hafiza_cached

    llm = open_llama(llama_cpp, loaded.path, max(contexts) + NEW_TOKENS + 64, threads)
    rows = []
    for ctx in contexts:
        ids = context_ids(loaded, ctx)
        llama_generate(llm, ids[:16], 4)  # warm-up
        hafiza_cached(loaded, ids[:16])
        runs: dict[str, list[tuple[float, float]]] = {"llama.cpp": [], "hafiza": []}
        for _ in range(repeats):
            runs["llama.cpp"].append(llama_generate(llm, ids, NEW_TOKENS))
            runs["hafiza"].append(hafiza_cached(loaded, ids))
        for system, samples in runs.items():
            total, first = _median_runs(samples)
            rows.append({"context": ctx, "system": system, "seconds": total, "prefill_s": first,
                         "decode_tokens_per_s": (NEW_TOKENS - 1) / (total - first) if total > first else 0.0,
                         "samples": len(samples)})
    del llm
    return rows


def bench_prompt_cache(llama_cpp: Any, loaded: Any, system_tokens: int, repeats: int, threads: int) -> list[dict]:
    """Cold vs warm TTFT with a shared system prompt (the prompts of `bench prefix`), both systems interleaved."""
    from hafiza.bench.engine_benches import QUESTIONS, chat_ids, system_prompt, ttft
    from hafiza.engine import EngineConfig, LLMEngine

    system = system_prompt(loaded, system_tokens)
    prompts = [chat_ids(loaded, system, q) for q in QUESTIONS]
    llm = open_llama(llama_cpp, loaded.path, max(len(p) for p in prompts) + 64, threads)
    engine = LLMEngine(loaded, EngineConfig(kv_memory="512MiB"))
    cold: dict[str, list[float]] = {"llama.cpp": [], "hafiza": []}
    warm: dict[str, list[float]] = {"llama.cpp": [], "hafiza": []}
    cached: dict[str, list[int]] = {"llama.cpp": [], "hafiza": []}
    ttft(engine, prompts[0], salt=None)  # warm-up, and the shared prefix cached for hafiza
    llama_ttft(llm, prompts[0])
    for i in range(repeats):
        ids, other = prompts[(i + 1) % len(prompts)], prompts[(i + 2) % len(prompts)]
        llm.reset()
        cold["llama.cpp"].append(llama_ttft(llm, ids)[0])
        cold["hafiza"].append(ttft(engine, ids, salt=f"cold-{i}")[0])
        t, n = llama_ttft(llm, other)
        warm["llama.cpp"].append(t)
        cached["llama.cpp"].append(n)
        t, n = ttft(engine, other, salt=None)
        warm["hafiza"].append(t)
        cached["hafiza"].append(n)
    rows = []
    for system_name in ("hafiza", "llama.cpp"):
        c, w = statistics.median(cold[system_name]), statistics.median(warm[system_name])
        rows.append({"system": system_name, "prompt_tokens": len(prompts[1]),
                     "cached_tokens": statistics.median(cached[system_name]), "cold_ttft_s": c, "warm_ttft_s": w,
                     "speedup": c / w, "repeats": repeats})
    del llm
    return rows


# -- servers under the `bench serve` load ---------------------------------------------------------------------


def find_llama_server(explicit: str | None) -> str | None:
    """The llama-server binary: --llama-server, settings.LLAMA_SERVER, or `llama-server` on PATH."""
    for candidate in (explicit, settings.LLAMA_SERVER.read(), shutil.which("llama-server")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def server_command(kind: str, binary: str | None, model: Path, port: int, slots: int, threads: int) -> list[str]:
    """How to start llama.cpp's server: the binary with `slots` parallel slots, or the Python one (one slot)."""
    if kind == "binary":
        assert binary is not None
        return [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
                "-c", str(slots * SLOT_CONTEXT), "-t", str(threads), "-tb", str(threads), "--no-webui"]
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1", "--port",
            str(port), "--n_ctx", str(SLOT_CONTEXT * 2), "--n_threads", str(threads), "--n_threads_batch",
            str(threads), "--interrupt_requests", "False"]


async def _load(url: str, cfg: serve_bench.Config) -> dict[str, Any]:
    """`bench serve`'s sessions against a llama.cpp server (OpenAI API), after a 1-token warm-up."""
    system = serve_bench.system_prompt(cfg)
    # A fresh connection per request: under this load llama-server (cpp-httplib) closed kept-alive connections
    # and the next request on one failed with "Server disconnected without sending a response".
    limits = httpx.Limits(max_connections=cfg.sessions + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        models = (await client.get("/v1/models")).json()
        model = models["data"][0]["id"]
        t0 = time.perf_counter()
        await serve_bench.openai_turn(client, model, system, [{"role": "user", "content": "warm-up"}], 1)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        sessions = await asyncio.gather(*(serve_bench.run_session(client, cfg, model, system, i)
                                          for i in range(cfg.sessions)))
        wall = time.perf_counter() - t0
    return {"cold_prefill_s": cold, **serve_bench.summarize([t for s in sessions for t in s], wall)}


def run_llama_server(cmd: list[str], port: int, cfg: serve_bench.Config, log: Path) -> dict[str, Any]:
    """Start llama.cpp's server (listening on `port`), run the load against it, stop it."""
    with log.open("w") as out:
        # llama-server runs as the user would start it: without the OpenMP defaults hafiza sets for itself
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=user_environment())
        try:
            url = f"http://127.0.0.1:{port}"
            wait_http(proc, f"{url}/v1/models", "the server", timeout_s=300)
            return asyncio.run(_load(url, cfg))
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def bench_servers(model: Path, cfg: serve_bench.Config, kinds: list[str], binary: str | None, slots: int,
                  threads: int, log_dir: Path) -> dict[str, Any]:
    """hafiza serve, then each llama.cpp server, under the same load; a server that fails gets an error row."""
    from hafiza.server.launch import free_port

    rows = []
    try:
        res = serve_bench.run_bench(replace(cfg, api="openai"))
        rows.append({"system": "hafiza serve (OpenAI API)", "slots": None, "weights": cfg.weights,
                     **{k: v for k, v in res.items() if k != "turns"}})
    except Exception as exc:
        rows.append({"system": "hafiza serve (OpenAI API)", "error": _short(exc)})
    print(server_line(rows[-1]), flush=True)
    for kind in kinds:
        label = (f"llama.cpp llama-server ({slots} parallel slots)" if kind == "binary"
                 else "llama.cpp `python -m llama_cpp.server` (1 slot: one request at a time)")
        try:
            port = free_port()
            cmd = server_command(kind, binary, model, port, slots, threads)
            res = run_llama_server(cmd, port, cfg, log_dir / f"llamacpp-{kind}-server.log")
            rows.append({"system": label, "slots": slots if kind == "binary" else 1, "command": " ".join(cmd),
                         **{k: v for k, v in res.items() if k != "turns"}})
        except Exception as exc:
            rows.append({"system": label, "error": _short(exc)})
        print(server_line(rows[-1]), flush=True)
    note = (f"{cfg.sessions} sessions x {cfg.turns} turns, {cfg.system_words}-word shared system prompt, "
            f"{cfg.max_tokens}-token greedy replies, OpenAI API with streaming")
    if "binary" not in kinds:
        note += (f"; no llama-server binary was found ({WHERE_LLAMA_SERVER}), so llama.cpp "
                 "ran only as llama-cpp-python's server, which has no parallel slots")
    return {"config": asdict(cfg), "note": note, "rows": rows}


def server_line(row: dict[str, Any]) -> str:
    """One server's figures as soon as its load is done, so a run stopped later still leaves them in its log."""
    if "error" in row:
        return f"  {row['system']}: {row['error']}"
    return (f"  {row['system']}: {row['aggregate_tok_s']:.2f} output tok/s, TTFT p50 {row['ttft_p50_s']:.2f} s, "
            f"p99 {row['ttft_p99_s']:.2f} s, {row['requests']} requests in {row['wall_s']:.0f} s")


def _short(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def run(model: str | None, contexts: list[int], repeats: int, system_tokens: int, cfg: serve_bench.Config,
        servers: str, binary: str | None, slots: int, log_dir: Path) -> dict[str, Any]:
    """Every part; each part that fails records its error instead of figures. hafiza's in-process parts and its
    server both use `cfg.weights`."""
    import torch

    from hafiza.bench.weights_worker import weights_label
    from hafiza.models import load_model

    llama_cpp, reason = llama_import()
    if llama_cpp is None:
        return {"available": False, "reason": reason}
    loaded = load_model(model, dtype="fp32", device="cpu", weights=cfg.weights)
    threads = torch.get_num_threads()
    data: dict[str, Any] = {
        "available": True, "version": llama_cpp.__version__, "model": loaded.path.name, "threads": threads,
        "new_tokens": NEW_TOKENS, "hafiza_dtype": "fp32", "hafiza_weights": weights_label(loaded),
        "load_average_start": os.getloadavg()[0],
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "system_info": llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()}
    try:
        data["decode"] = bench_decode(llama_cpp, loaded, contexts, repeats, threads)
    except Exception as exc:
        data["decode"] = [{"error": _short(exc)}]
    try:
        data["prompt_cache"] = bench_prompt_cache(llama_cpp, loaded, system_tokens, repeats, threads)
    except Exception as exc:
        data["prompt_cache"] = [{"system": "llama.cpp", "error": _short(exc)}]
    found = find_llama_server(binary)
    kinds = {"auto": ["binary"] if found else ["python"], "binary": ["binary"], "python": ["python"],
             "both": ["binary", "python"] if found else ["python"], "none": []}[servers]
    if "binary" in kinds and not found:
        data["server"] = {"rows": [{"system": "llama.cpp llama-server", "error": "no llama-server binary found "
                                    f"({WHERE_LLAMA_SERVER})"}]}
    elif kinds:
        data["server"] = bench_servers(loaded.path, cfg, kinds, found, slots, threads, log_dir)
    data["load_average_end"] = os.getloadavg()[0]
    return data


def register(bench_app: typer.Typer) -> None:
    """Add `hafiza bench llamacpp`."""

    @bench_app.command("llamacpp")
    def llamacpp(
        json_path: Annotated[str | None, typer.Option("--json", help="Where to write the JSON results.")] = None,
        model: Annotated[str | None, typer.Option(help="GGUF file (default: SmolLM2-135M Q4_1).")] = None,
        contexts: Annotated[str, typer.Option(help="Context lengths for prefill/decode.")] = "128,1024",
        repeats: Annotated[int, typer.Option(help="Runs per measurement (median reported).")] = 3,
        system_tokens: Annotated[int, typer.Option(help="Shared system prompt for the prompt cache.")] = 2000,
        sessions: Annotated[int, typer.Option(help="Concurrent chat sessions against the servers.")] = 8,
        turns: Annotated[int, typer.Option(help="Turns per session.")] = 4,
        max_tokens: Annotated[int, typer.Option(help="Reply length per turn.")] = 32,
        system_words: Annotated[int, typer.Option(help="Shared system prompt of the chat load, in words.")] = 1100,
        servers: Annotated[str, typer.Option(help="Which llama.cpp server: auto (the binary if found, else "
                                                  "Python), binary, python, both or none.")] = "auto",
        llama_server: Annotated[str | None, typer.Option(help="Path of a llama-server binary.")] = None,
        slots: Annotated[int | None, typer.Option(help="llama-server parallel slots (default: --sessions).")
                         ] = None,
        weights: Weights = "auto",
    ) -> None:
        """llama.cpp on the same GGUF, interleaved with hafiza: decode, prefill, prompt cache, server under load."""
        from rich.console import Console

        from hafiza.errors import HafizaError
        from hafiza.models.weights import check_weights_mode

        check_weights_mode(weights)
        if servers not in ("auto", "binary", "python", "both", "none"):
            raise HafizaError(f"--servers must be auto, binary, python, both or none, got {servers!r}")
        if min(repeats, sessions, turns, max_tokens, system_words, system_tokens) < 1:
            raise HafizaError("--repeats, --sessions, --turns, --max-tokens and the prompt sizes must be positive")
        cfg = serve_bench.Config(sessions, turns, max_tokens, system_words, api="openai", weights=weights)
        out = Path(json_path) if json_path else Path("bench/results/llamacpp.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        data = run(model, [int(c) for c in contexts.split(",")], repeats, system_tokens, cfg, servers,
                   llama_server, slots or sessions, out.parent)
        print_tables(data, Console())
        print(f"wrote {write_json(data, out, 'llamacpp.json')}")


def print_tables(data: dict[str, Any], console: Any) -> None:
    """The figures as rich tables (the same as the docs' region)."""
    from rich.table import Table

    if not data["available"]:
        console.print(f"llama.cpp peer not measured: {data['reason']}")
        return
    for title, rows, cols in (
        ("prefill + decode", data.get("decode", []),
         ("context", "system", "prefill_s", "decode_tokens_per_s", "seconds", "error")),
        ("prompt cache", data.get("prompt_cache", []),
         ("system", "prompt_tokens", "cached_tokens", "cold_ttft_s", "warm_ttft_s", "speedup", "error")),
        ("servers under the same chat load", data.get("server", {}).get("rows", []),
         ("system", "requests", "ttft_p50_s", "ttft_p99_s", "aggregate_tok_s", "usage_hit_rate", "error")),
    ):
        if not rows:
            continue
        used = [c for c in cols if any(c in r for r in rows)]
        table = Table(title=f"llama.cpp vs hafiza: {title}")
        for c in used:
            table.add_column(c, justify="left" if c == "system" else "right")
        for r in rows:
            table.add_row(*[_cell(r.get(c)) for c in used])
        console.print(table)


def _cell(v: Any) -> str:
    if v is None:
        return ""
    return f"{v:.3f}" if isinstance(v, float) else str(v)
