"""`hafiza bench quality`: what each lossy KV format and eviction policy costs in quality, against bf16 KV.

Every configuration runs through `LLMEngine`, the scheduler and runner that `hafiza serve --kv-dtype F
--eviction P --kv-budget-tokens B --max-num-batched-tokens C --max-num-seqs 1` runs (`quality_runs`). Per
configuration: teacher-forced perplexity of real texts from the prompt's logprobs, prefilled in C-token chunks
that attend to the K/V read back from the pool; agreement of greedy continuations with bf16 at points of each
text; and stored KV bytes per token. transformers' QuantizedCache runs on the same weights and tokens in the same
run, against its own full-precision cache.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from rich.console import Console
from rich.table import Table

from hafiza.bench.common import write_json
from hafiza.bench.quality_runs import TextRun, agreement, engine_config, greedy_points, run_text, token_match
from hafiza.engine import LLMEngine
from hafiza.errors import HafizaError
from hafiza.models import LoadedModel, load_model

TEXT_DIR = Path("bench/texts/quality")
TARGETS_PCT = {"int8": 0.5, "fp8": 1.0, "int4": 3.0}
BASELINE = "bf16"


@dataclass(frozen=True)
class Setup:
    """What the benchmark runs: tokens per text, chunk, continuation points, eviction budget."""

    tokens: int = 4096
    chunk: int = 64
    points: int = 3
    gen_tokens: int = 64
    budget_tokens: int = 1024
    block_size: int = 16


def load_texts(loaded: LoadedModel, files: list[Path], tokens: int) -> list[tuple[str, list[int]]]:
    """(name, the first `tokens` token ids) of each text file."""
    if not files:
        raise HafizaError(f"no quality texts: pass --text FILE or put .txt files under {TEXT_DIR}/")
    out = []
    for f in files:
        if not f.exists():
            raise HafizaError(f"quality text not found: {f}")
        ids = loaded.tokenizer.encode(f.read_text(encoding="utf-8"))[:tokens]
        if len(ids) < 2:
            raise HafizaError(f"quality text {f} has fewer than 2 tokens")
        out.append((f.name, ids))
    return out


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _summarise(runs: list[TextRun], refs: list[TextRun] | None) -> dict[str, Any]:
    nll, scored = sum(r.nll_sum for r in runs), sum(r.scored for r in runs)
    row: dict[str, Any] = {"perplexity": math.exp(nll / scored),
                           "per_text_perplexity": [math.exp(r.nll_sum / r.scored) for r in runs]}
    if refs is not None:
        pairs = [(ref.continuations[p], run.continuations[p]) for run, ref in zip(runs, refs, strict=True)
                 for p in sorted(ref.continuations)]
        row["greedy_agreement"] = sum(agreement(a, b) for a, b in pairs) / len(pairs)
        row["greedy_token_match"] = sum(token_match(a, b) for a, b in pairs) / len(pairs)
        row["greedy_points"] = len(pairs)
    return row


def hafiza_rows(loaded: LoadedModel, texts: list[tuple[str, list[int]]], formats: list[str],
                policies: list[str], setup: Setup) -> list[dict[str, Any]]:
    """One row per format (no eviction) and per policy (bf16 pool, `budget_tokens` of KV), each from a fresh
    engine with the served configuration (`quality_runs.engine_config`)."""
    configs = [(BASELINE, None)] + [(f, None) for f in formats if f != BASELINE] + [(BASELINE, p) for p in policies]
    longest = max(len(ids) for _, ids in texts) + setup.gen_tokens
    runs: dict[tuple[str, str | None], list[TextRun]] = {}
    stored: dict[tuple[str, str | None], tuple[float, int]] = {}
    for fmt, policy in configs:
        t0 = time.perf_counter()
        engine = LLMEngine(loaded, engine_config(loaded, fmt, policy, setup.budget_tokens if policy else None,
                                                 setup.chunk, longest, setup.block_size))
        runs[fmt, policy] = [run_text(engine, ids, greedy_points(len(ids), setup.chunk, setup.points),
                                      setup.gen_tokens) for _, ids in texts]
        stats = engine.stats()
        stored[fmt, policy] = (stats.bytes_per_block / setup.block_size, stats.evicted_tokens)
        _log(f"  hafiza {fmt}{'+' + policy if policy else ''}: {time.perf_counter() - t0:.0f} s")
    base = runs[BASELINE, None]
    base_ppl = _summarise(base, None)["perplexity"]
    rows = []
    for (fmt, policy), rs in runs.items():
        bytes_per_token, evicted = stored[fmt, policy]
        row = {"system": "hafiza", "format": fmt, "policy": policy, **_summarise(rs, base),
               "bytes_per_token": bytes_per_token}
        row["ppl_increase_pct"] = 100 * (row["perplexity"] / base_ppl - 1)
        if policy:
            row["budget_tokens"] = setup.budget_tokens
            row["evicted_tokens"] = evicted
        if fmt in TARGETS_PCT and not policy:
            row["target_pct"] = TARGETS_PCT[fmt]
            row["target_met"] = row["ppl_increase_pct"] <= TARGETS_PCT[fmt]
        rows.append(row)
    return rows


def peer_rows(loaded: LoadedModel, texts: list[tuple[str, list[int]]], setup: Setup) -> list[dict[str, Any]]:
    """transformers' caches on the same weights; a backend that does not install or run gets an error row."""
    from hafiza.bench.peers import transformers_model
    from hafiza.bench.quality_peer import PEERS, peer_bytes_per_token, run_peer

    c = loaded.config
    try:
        hf = transformers_model(loaded)
    except Exception as exc:
        return [{"system": "transformers", "format": p.name, "policy": None, "error": f"model: {exc}"}
                for p in PEERS]
    runs: dict[str, list[TextRun] | str] = {}
    for peer in PEERS:
        t0 = time.perf_counter()
        try:
            runs[peer.name] = [run_peer(hf, ids, peer, setup.chunk, setup.gen_tokens) for _, ids in texts]
        except Exception as exc:
            runs[peer.name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        _log(f"  transformers {peer.name}: {time.perf_counter() - t0:.0f} s")
    base = runs[PEERS[0].name]
    rows = []
    for peer in PEERS:
        row: dict[str, Any] = {"system": "transformers", "format": peer.name, "policy": None, "note": peer.note,
                               "bytes_per_token": peer_bytes_per_token(peer, c.num_layers, c.num_kv_heads,
                                                                       c.head_dim)}
        rs = runs[peer.name]
        if isinstance(rs, str) or isinstance(base, str):
            row["error"] = rs if isinstance(rs, str) else f"baseline failed: {base}"
        else:
            row |= _summarise(rs, base)
            row["ppl_increase_pct"] = 100 * (row["perplexity"] / _summarise(base, None)["perplexity"] - 1)
        rows.append(row)
    return rows


def run(model: str | None, files: list[Path], formats: list[str], policies: list[str], setup: Setup,
        peer: bool, device: str, weights: str = "fp32") -> dict[str, Any]:
    """The whole benchmark: hafiza rows, then the transformers peer rows (which compute with the weights
    dequantized exactly, so `weights` fp32 gives both systems the same numbers)."""
    loaded = load_model(model, dtype="fp32", device=device, weights=weights)
    texts = load_texts(loaded, files, setup.tokens)
    _log(f"quality: {len(texts)} texts x {[len(t) for _, t in texts]} tokens, chunk {setup.chunk}")
    rows = hafiza_rows(loaded, texts, formats, policies, setup)
    if peer:
        rows += peer_rows(loaded, texts, setup)
    return {"model": loaded.name, "compute_dtype": "fp32", "weights": weights, "device": str(loaded.device),
            "baseline": BASELINE,
            "torch_threads": torch.get_num_threads(),
            "chunk": setup.chunk, "gen_tokens": setup.gen_tokens, "points_per_text": setup.points,
            "budget_tokens": setup.budget_tokens, "block_size": setup.block_size,
            "served_as": (f"hafiza serve --weights {weights} --dtype fp32 --kv-dtype F --max-num-batched-tokens "
                          f"{setup.chunk} --max-num-seqs 1 --block-size {setup.block_size} "
                          f"[--eviction P --kv-budget-tokens {setup.budget_tokens}]"),
            "texts": [{"name": n, "tokens": len(t)} for n, t in texts], "results": rows}


def _fmt(row: dict[str, Any], key: str, spec: str) -> str:
    return format(row[key], spec) if row.get(key) is not None else ""


def print_table(data: dict[str, Any]) -> None:
    """The results as one table."""
    title = (f"KV quality vs {data['baseline']} KV: {data['model']}, {len(data['texts'])} texts, chunk "
             f"{data['chunk']}, eviction budget {data['budget_tokens']} tokens")
    table = Table(title=title)
    for col in ("system", "format", "policy", "perplexity", "increase", "target", "greedy agree", "token match",
                "bytes/token"):
        table.add_column(col, justify="right")
    for r in data["results"]:
        target = "" if "target_pct" not in r else f"≤ {r['target_pct']} % {'met' if r['target_met'] else 'MISSED'}"
        if "error" in r:
            table.add_row(r["system"], r["format"], "", "did not run", r["error"][:60], "", "", "", "")
            continue
        table.add_row(r["system"], r["format"], r["policy"] or "", _fmt(r, "perplexity", ".4f"),
                      _fmt(r, "ppl_increase_pct", "+.2f") + " %", target, _fmt(r, "greedy_agreement", ".2f"),
                      _fmt(r, "greedy_token_match", ".2f"), _fmt(r, "bytes_per_token", ".0f"))
    Console().print(table)


def plot(data: dict[str, Any], path: Path) -> None:
    """Perplexity increase against stored KV bytes per token of context, one labelled point per configuration.

    Eviction rows are placed at bytes_per_token x budget / text length: the memory they really hold per token.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = max((t["tokens"] for t in data.get("texts", [])), default=0)
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=90)
    rows = [r for r in data["results"] if r.get("perplexity") is not None]
    for i, r in enumerate(rows):
        label = r["format"] + (f"+{r['policy']}" if r["policy"] else "")
        bpt = r["bytes_per_token"]
        if r.get("budget_tokens") and tokens:
            bpt *= min(1.0, r["budget_tokens"] / tokens)
        colour = "tab:blue" if r["system"] == "hafiza" else "tab:orange"
        x, y = bpt / 1024, r["ppl_increase_pct"]
        ax.scatter(x, y, color=colour, marker="s" if r["policy"] else "o")
        ax.annotate(label, (x, y), fontsize=7, xytext=(5, (6, -11, 14)[i % 3]), textcoords="offset points")
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_ylim(-0.5, max([r["ppl_increase_pct"] for r in rows] + [1.0]) * 2.5)
    ax.set_xlabel("stored KV per token of context (KiB; squares: eviction to a budget)")
    ax.set_ylabel(f"perplexity increase vs {data['baseline']} KV (%)")
    ax.set_title(f"{data['model']}: hafiza (blue), transformers (orange)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def register(bench_app: typer.Typer) -> None:
    """Add `hafiza bench quality` to the bench command group."""

    @bench_app.command("quality")
    def quality(
        text: Annotated[list[Path] | None, typer.Option("--text", help="Text file (repeatable); default: "
                                                        f"every .txt under {TEXT_DIR}/.")] = None,
        json_path: Annotated[str | None, typer.Option("--json", help="Where to write the JSON results.")] = None,
        plot_path: Annotated[Path | None, typer.Option("--plot", help="Write a PNG plot here.")] = None,
        model: Annotated[str | None, typer.Option(help="GGUF file or model directory.")] = None,
        device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
        weights: Annotated[str, typer.Option(help="Weight format (see `hafiza serve --help`); fp32, the exact "
                                             "dequantized weights, is what the transformers peer computes with.")
                           ] = "fp32",
        tokens: Annotated[int, typer.Option(help="Tokens evaluated per text.")] = 4096,
        chunk: Annotated[int, typer.Option(help="Prefill chunk: the engine's max_num_batched_tokens.")] = 64,
        points: Annotated[int, typer.Option(help="Greedy continuation points per text.")] = 3,
        gen: Annotated[int, typer.Option(help="Tokens per greedy continuation.")] = 64,
        formats: Annotated[str, typer.Option(help="KV formats (comma-separated; fp32 too).")] = "bf16,fp8,int8,int4",
        policies: Annotated[str, typer.Option(help="Eviction policies on bf16 KV ('' for none).")] = "streaming,h2o",
        budget: Annotated[int, typer.Option(help="KV tokens kept per sequence under eviction.")] = 1024,
        peer: Annotated[bool, typer.Option(help="Also run transformers' QuantizedCache.")] = True,
        threads: Annotated[int, typer.Option(help="torch CPU threads (0: torch's default). On a shared, "
                                             "oversubscribed machine 1 is several times faster.")] = 0,
    ) -> None:
        """Perplexity, greedy agreement and bytes per token of each KV format and eviction policy vs bf16."""
        if threads > 0:
            torch.set_num_threads(threads)
        files = list(text) if text else sorted(TEXT_DIR.glob("*.txt"))
        setup = Setup(tokens=tokens, chunk=chunk, points=points, gen_tokens=gen, budget_tokens=budget)
        split = [s for s in formats.split(",") if s]
        data = run(model, files, split, [p for p in policies.split(",") if p], setup, peer, device, weights)
        print_table(data)
        print(f"wrote {write_json(data, json_path, 'quality.json')}")
        if plot_path:
            plot(data, plot_path)
            print(f"wrote {plot_path}")
