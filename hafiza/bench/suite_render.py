"""Markdown tables and matplotlib plots for each benchmark's JSON, as `hafiza bench all` writes them to the docs.

The llama.cpp peer's figures (`bench llamacpp`) are added next to hafiza's in the cache, prefix and serve
regions; where llama.cpp could not be installed or run, the table says so instead of showing a number.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hafiza.bench.markdown import table


@dataclass
class Context:
    """Everything a renderer may need: all benchmarks' JSON of this run, where plots go, the run's facts."""

    data: dict[str, dict[str, Any] | None]
    docs: Path
    quick: bool
    machine: dict[str, Any]
    date: str
    conditions: str = ""

    @property
    def machine_line(self) -> str:
        m = self.machine
        gpu = f", GPU {m['gpu']}" if m.get("gpu") else ""
        isa = f" ({m['cpu_isa']})" if m.get("cpu_isa") else ""
        return (f"{m.get('cpu', '?')}{isa}, {m.get('cores', '?')} cores, torch {m.get('torch', '?')} with "
                f"{m.get('torch_threads', '?')} threads{gpu}")

    @property
    def llamacpp(self) -> dict[str, Any] | None:
        return self.data.get("llamacpp")

    def llama_missing(self) -> str | None:
        """Why there are no llama.cpp figures in this run (None when there are)."""
        peer = self.llamacpp
        if peer is None:
            return "`hafiza bench llamacpp` did not run or failed in this invocation"
        if not peer.get("available"):
            return f"not installed or not loadable: {peer.get('reason', 'unknown')}"
        return None

    def image(self, name: str, alt: str) -> str:
        """A markdown image of DOCS/NAME if the plot exists, else nothing."""
        return f"\n\n![{alt}]({name})" if (self.docs / name).exists() else ""

    def generic(self, data: dict[str, Any]) -> str:
        """Top-level scalars of a JSON result, for a benchmark without its own renderer."""
        rows = [[k, _num(v)] for k, v in data.items() if isinstance(v, int | float | str) and k != "timestamp"]
        return table(["field", "value"], rows) if rows else "_No scalar figures._"


def _num(v: Any, spec: str = ".3g") -> str:
    if v is None:
        return "–"
    if isinstance(v, bool) or not isinstance(v, int | float):
        return str(v)
    return format(v, spec)


def _s(v: float | None) -> str:
    return "–" if v is None else (f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s")


def _plot(path: Path, draw: Callable[[Any], None], size: tuple[float, float] = (7.0, 3.4)) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=size, dpi=90)
    draw(fig)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _bars(ax: Any, groups: list[str], series: dict[str, list[float | None]], ylabel: str) -> None:
    """Grouped bars: one group per x label, one bar per series (missing values left out)."""
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        xs = [g + i * width for g, v in enumerate(values) if v is not None]
        ax.bar(xs, [v for v in values if v is not None], width, label=label)
    ax.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))], groups)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)


# -- engine core: KV cache vs recompute -------------------------------------------------------------------


def render_cache(data: dict[str, Any], ctx: Context) -> str:
    rows = [[r["context"], r["system"], "yes" if r["cache"] else "no", f"{r['seconds']:.2f}",
             f"{r['decode_tokens_per_s']:.1f}", _s(r["ttft_s"]),
             f"{r['compute_reduction_pct']:.0f} %" if r["cache"] else ""] for r in data["results"]]
    missing = ctx.llama_missing()
    peer = [] if missing else [d for d in ctx.llamacpp.get("decode", []) if d["system"] == "llama.cpp"]
    for d in peer:
        rows.append([d["context"], "llama.cpp (Q4_1 weights, peer)", "yes", f"{d['seconds']:.2f}",
                     f"{d['decode_tokens_per_s']:.1f}", _s(d["prefill_s"]), ""])
    if missing:
        rows.append(["", "llama.cpp (peer)", "", "", missing, "", ""])
    text = (f"{data['new_tokens']} new tokens after a context of real English text, {data['model']} ({data['dtype']},"
            f" {data['device']}); medians. TTFT = prefill of the context plus the first token.\n\n")
    text += table(["context", "system", "KV cache", "seconds", "decode tok/s", "TTFT", "compute saved"], rows)
    contexts = sorted({r["context"] for r in data["results"]})
    ratios = []
    for c in contexts:
        ours, hf = (next((r for r in data["results"] if r["context"] == c and r["system"] == s and r["cache"]), None)
                    for s in ("hafiza", "transformers"))
        if ours and hf and hf["decode_tokens_per_s"] and ours["ttft_s"]:
            ratios.append(f"context {c}: decode {ours['decode_tokens_per_s'] / hf['decode_tokens_per_s']:.2f}x "
                          f"transformers', TTFT {hf['ttft_s'] / ours['ttft_s']:.2f}x")
    if ratios:
        text += "\n\nhafiza vs transformers (same weights and dtype, same run): " + "; ".join(ratios) + "."

    def pick(system: str, cache: bool) -> list[float | None]:
        return [next((r["decode_tokens_per_s"] for r in data["results"] if r["context"] == c
                      and r["system"] == system and r["cache"] == cache), None) for c in contexts]

    series = {"hafiza": pick("hafiza", True), "hafiza, no KV cache": pick("hafiza", False),
              "transformers": pick("transformers", True), "transformers, no KV cache": pick("transformers", False)}
    if peer:
        series["llama.cpp"] = [next((d["decode_tokens_per_s"] for d in peer if d["context"] == c), None)
                               for c in contexts]

    def draw(fig: Any) -> None:
        ax = fig.add_subplot()
        _bars(ax, [f"context {c}" for c in contexts], series, "decode tokens/s (64 new tokens)")
        ax.set_title("Decode speed with and without the KV cache", fontsize=9)

    _plot(ctx.docs / "bench_cache.png", draw)
    return text + ctx.image("bench_cache.png", "decode tokens per second by context and system")


# -- prefix caching, batching and memory ------------------------------------------------------------------


def render_prefix(data: dict[str, Any], ctx: Context) -> str:
    rows = [["hafiza (`bench prefix`)", data["prompt_tokens"], f"{data['cached_tokens']:.0f}",
             _s(data["cold_ttft_s"]), _s(data["warm_ttft_s"]), f"{data['speedup']:.1f}x"]]
    missing = ctx.llama_missing()
    for p in [] if missing else ctx.llamacpp.get("prompt_cache", []):
        if "error" in p:
            rows.append([f"{p['system']} (same run as llama.cpp)", "", "", p["error"], "", ""])
            continue
        label = "llama.cpp prompt cache (peer)" if p["system"] == "llama.cpp" else "hafiza (same run as llama.cpp)"
        rows.append([label, p["prompt_tokens"], f"{p['cached_tokens']:.0f}", _s(p["cold_ttft_s"]),
                     _s(p["warm_ttft_s"]), f"{p['speedup']:.1f}x"])
    if missing:
        rows.append(["llama.cpp prompt cache (peer)", "", "", missing, "", ""])
    return ("Time to first token of a chat request after a long shared system prompt: cold (nothing cached) "
            "and warm (the system prompt cached by an earlier request with another question); medians.\n\n"
            + table(["system", "prompt tokens", "cached tokens", "cold TTFT", "warm TTFT", "speed-up"], rows))


def render_batch(data: dict[str, Any], ctx: Context) -> str:
    rows = [[r["streams"], r["tokens"], f"{r['seconds']:.2f}", f"{r['tokens_per_s']:.1f}",
             f"{r['speedup_vs_1']:.1f}x"] for r in data["results"]]

    def draw(fig: Any) -> None:
        ax = fig.add_subplot()
        ax.plot([r["streams"] for r in data["results"]], [r["tokens_per_s"] for r in data["results"]], "o-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("aggregate tokens/s")
        ax.set_title(f"Continuous batching, {data['new_tokens']} tokens per stream", fontsize=9)

    _plot(ctx.docs / "bench_batch.png", draw, (5.0, 3.2))
    weights = f"Weights: {data['weights']}.\n\n" if data.get("weights") else ""
    return (weights + table(["streams", "tokens", "seconds", "tok/s", "vs 1 stream"], rows)
            + ctx.image("bench_batch.png", "aggregate tokens per second by number of streams"))


def render_memory(data: dict[str, Any], ctx: Context) -> str:
    return table(["requests", "max length", "block size", "paged waste", "contiguous waste", "memory saved"],
                 [[data["requests"], data["max_len"], data["block_size"], f"{data['paged_waste_pct']:.1f} %",
                   f"{data['contiguous_waste_pct']:.1f} %", f"{data['memory_saved_pct']:.1f} %"]])


# -- server ----------------------------------------------------------------------------------------------


def _serve_row(label: str, r: dict[str, Any]) -> list[str]:
    return [label, str(r["requests"]), _s(r["ttft_p50_s"]), _s(r["ttft_p99_s"]), f"{r['aggregate_tok_s']:.1f}",
            f"{r['usage_hit_rate']:.1%}" if r.get("usage_hit_rate") is not None else "not reported",
            f"{r['wall_s']:.0f} s"]


def _short_label(system: str) -> str:
    """A two-line x label for a server row."""
    if system.startswith("hafiza serve ("):
        return "hafiza serve\n" + system[len("hafiza serve ("):].rstrip(")")
    if "llama-server" in system:
        slots = system.split("(", 1)[1].split(" ")[0] if "(" in system else "?"
        return f"llama-server\n{slots} slots"
    if "llama_cpp.server" in system:
        return "llama_cpp.server\n1 slot"
    return system[:18]


def render_serve(data: dict[str, Any], ctx: Context) -> str:
    cfg, res = data["config"], data["results"]
    rows = [_serve_row(f"hafiza serve ({cfg['api']} API)", res)]
    missing = ctx.llama_missing()
    server = {} if missing else ctx.llamacpp.get("server", {})
    for r in server.get("rows", []):
        if "error" in r:
            rows.append([r["system"], "", r["error"], "", "", "", ""])
        else:
            rows.append(_serve_row(r["system"], r))
    if missing:
        rows.append(["llama.cpp server (peer)", "", missing, "", "", "", ""])
    text = (f"{cfg['sessions']} concurrent chat sessions × {cfg['turns']} turns over HTTP with streaming, a shared "
            f"system prompt of {cfg['system_words']} words, {cfg['max_tokens']}-token greedy replies; "
            f"TTFT measured by the client to the first text.")
    if cfg.get("weights"):
        text += f" hafiza serve ran with `--weights {cfg['weights']}`."
    if server.get("config"):
        sc = server["config"]
        text += (f" The llama.cpp rows ran the same load generator with {sc['sessions']} sessions × {sc['turns']} "
                 f"turns, OpenAI API, against both servers in turn.")
    text += "\n\n" + table(["server", "requests", "TTFT p50", "TTFT p99", "output tok/s", "prefix hit rate",
                            "wall"], rows)
    ok = [(f"hafiza serve ({cfg['api']} API)", res)]
    ok += [(r["system"], r) for r in server.get("rows", []) if "ttft_p50_s" in r]

    def draw(fig: Any) -> None:
        ax1, ax2 = fig.subplots(1, 2)
        names = [_short_label(n) for n, _ in ok]
        ax1.bar(range(len(ok)), [r["ttft_p50_s"] for _, r in ok], label="p50")
        ax1.scatter(range(len(ok)), [r["ttft_p99_s"] for _, r in ok], color="black", marker="_", s=200, label="p99")
        ax1.set_xticks(range(len(ok)), names, fontsize=7)
        ax1.set_ylabel("TTFT (s)")
        ax1.legend(fontsize=7)
        ax2.bar(range(len(ok)), [r["aggregate_tok_s"] for _, r in ok], color="tab:green")
        ax2.set_xticks(range(len(ok)), names, fontsize=7)
        ax2.set_ylabel("aggregate output tokens/s")

    _plot(ctx.docs / "bench_serve.png", draw, (7.5, 3.4))
    return text + ctx.image("bench_serve.png", "TTFT and throughput of the servers under the same chat load")


# -- issues 5, 6, 7 ------------------------------------------------------------------------------------------


def render_codec(data: dict[str, Any], ctx: Context) -> str:
    rows = sorted((c for c in data["coders"] if c["kv_dtype"] == "bf16"), key=lambda c: c["bits_per_value"])
    body = table(["coder", "kind", "bits/value K", "V", "all", "encode MB/s", "decode MB/s", "lossless"],
                 [[c["coder"], c.get("kind", ""), f"{c['bits_k']:.2f}", f"{c['bits_v']:.2f}",
                   f"{c['bits_per_value']:.2f}", f"{c['encode_MBps']:.1f}", f"{c['decode_MBps']:.1f}",
                   c["lossless"]] for c in rows])
    texts = ", ".join(t.get("text", "?") for t in data.get("texts", []))
    return (f"bf16 KV of {data['tokens']} tokens per text ({texts}), one thread, sorted by size.\n\n{body}"
            + ctx.image("bench_codec.png", "bits per value against decode speed"))


def render_tiers(data: dict[str, Any], ctx: Context) -> str:
    rows = [["recompute", "", _s(data["recompute_ttft_s"]), "1.0x", "0", ""]]
    rows += [[r["tier"], r["codec"], _s(r["ttft_s"]), f"{r['speedup']:.1f}x", r["loaded_tokens"],
              f"{r['bytes_per_token']:.0f}"] for r in data["results"]]
    codecs = table(["codec", "B/token", "ratio vs raw", "encode ms/block", "decode ms/block"],
                   [[r["codec"], f"{r['bytes_per_token']:.0f}", f"{r['ratio']:.3f}",
                     f"{r['encode_ms_per_block']:.2f}", f"{r['decode_ms_per_block']:.2f}"] for r in data["codecs"]])

    def draw(fig: Any) -> None:
        ax = fig.add_subplot()
        names = ["recompute", *(r["tier"] for r in data["results"])]
        ax.bar(names, [data["recompute_ttft_s"], *(r["ttft_s"] for r in data["results"])],
               color=["grey", *["tab:blue"] * len(data["results"])])
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"{data['prompt_tokens']}-token prompt: prefix from each tier vs recompute", fontsize=9)

    _plot(ctx.docs / "bench_tiers.png", draw, (5.5, 3.2))
    return (f"TTFT of a {data['prompt_tokens']}-token prompt whose prefix is loaded from each tier, median of "
            f"{data['repeats']}.\n\n" + table(["source", "codec", "TTFT", "speed-up", "loaded tokens",
                                                "stored B/token"], rows)
            + "\n\n" + codecs + ctx.image("bench_tiers.png", "TTFT by KV source"))


def render_quality(data: dict[str, Any], ctx: Context) -> str:
    rows = []
    for r in data["results"]:
        if "error" in r:
            rows.append([r["system"], r["format"], "", "did not run: " + r["error"][:120], "", "", ""])
            continue
        rows.append([r["system"], r["format"], r.get("policy") or "", f"{r['perplexity']:.4f}",
                     f"{r.get('ppl_increase_pct', 0):+.2f} %", _num(r.get("greedy_agreement"), ".2f"),
                     _num(r.get("bytes_per_token"), ".0f")])
    texts = ", ".join(f"{t['name']} ({t['tokens']})" for t in data.get("texts", []))
    return (f"Perplexity through each KV format and eviction policy against {data['baseline']} KV; texts: "
            f"{texts}.\n\n" + table(["system", "format", "policy", "perplexity", "increase", "greedy agreement",
                                     "bytes/token"], rows)
            + ctx.image("bench_quality.png", "perplexity increase against stored bytes per token"))


# -- the llama.cpp peer and the suite ---------------------------------------------------------------------


def render_llamacpp(data: dict[str, Any], ctx: Context) -> str:
    if not data.get("available"):
        return f"**llama.cpp could not be measured**: {data.get('reason', 'unknown')}."
    hafiza_weights = (f"weights {data['hafiza_weights']}" if data.get("hafiza_weights") else
                      f"them dequantised to {data.get('hafiza_dtype', 'fp32')}")
    parts = [f"llama-cpp-python {data['version']} on `{data['model']}` (the same GGUF hafiza loads; llama.cpp "
             f"computes with its Q4_1 weights, hafiza with {hafiza_weights}), "
             f"{data['threads']} threads each, runs interleaved. llama.cpp CPU features: `{data['system_info']}`. "
             f"Load average {_num(data.get('load_average_start'), '.1f')} at the start, "
             f"{_num(data.get('load_average_end'), '.1f')} at the end; OMP_WAIT_POLICY "
             f"{data.get('omp_wait_policy') or 'not set'}."]
    decode = data.get("decode", [])
    if decode and "error" not in decode[0]:
        parts.append(f"**Prefill and decode** ({data['new_tokens']} greedy tokens after the context):\n\n" + table(
            ["context", "system", "prefill + 1st token", "decode tok/s", "total"],
            [[d["context"], d["system"], _s(d["prefill_s"]), f"{d['decode_tokens_per_s']:.1f}", _s(d["seconds"])]
             for d in decode]))
    elif decode:
        parts.append(f"Prefill/decode did not run: {decode[0]['error']}")
    cache = data.get("prompt_cache", [])
    if cache:
        parts.append("**Prompt cache**: TTFT with a shared system prompt, cold vs warm:\n\n" + table(
            ["system", "prompt tokens", "cached tokens", "cold", "warm", "speed-up"],
            [[p["system"], p.get("prompt_tokens", ""), _num(p.get("cached_tokens"), ".0f"),
              _s(p.get("cold_ttft_s")), _s(p.get("warm_ttft_s")),
              f"{p['speedup']:.1f}x" if "speedup" in p else p.get("error", "")] for p in cache]))
    server = data.get("server", {})
    if server:
        parts.append(f"**Servers under the same chat load** ({server.get('note', '')}):\n\n" + table(
            ["server", "requests", "TTFT p50", "TTFT p99", "output tok/s", "prefix hit rate", "wall"],
            [_serve_row(r["system"], r) if "error" not in r else [r["system"], "", r["error"], "", "", "", ""]
             for r in server.get("rows", [])]))
    _plot_llamacpp(data, ctx)
    return "\n\n".join(parts) + ctx.image("bench_llamacpp.png", "hafiza and llama.cpp: prefill, decode, prompt cache")


def _plot_llamacpp(data: dict[str, Any], ctx: Context) -> None:
    decode = [d for d in data.get("decode", []) if "error" not in d]
    cache = [p for p in data.get("prompt_cache", []) if "error" not in p]
    if not decode and not cache:
        return
    systems = sorted({d["system"] for d in decode})
    contexts = sorted({d["context"] for d in decode})

    def value(system: str, c: int, key: str) -> float | None:
        return next((d[key] for d in decode if d["system"] == system and d["context"] == c), None)

    def draw(fig: Any) -> None:
        ax1, ax2, ax3 = fig.subplots(1, 3)
        labels = [f"ctx {c}" for c in contexts]
        _bars(ax1, labels, {s: [value(s, c, "prefill_s") for c in contexts] for s in systems}, "prefill + 1st (s)")
        _bars(ax2, labels, {s: [value(s, c, "decode_tokens_per_s") for c in contexts] for s in systems},
              "decode tokens/s")
        _bars(ax3, ["cold", "warm"], {p["system"]: [p["cold_ttft_s"], p["warm_ttft_s"]] for p in cache},
              "prompt-cache TTFT (s)")

    _plot(ctx.docs / "bench_llamacpp.png", draw, (9.0, 3.2))


RENDERERS: dict[str, Callable[[dict[str, Any], Context], str]] = {
    "cache": render_cache, "prefix": render_prefix, "batch": render_batch, "memory": render_memory,
    "serve": render_serve, "codec": render_codec, "tiers": render_tiers, "quality": render_quality,
    "llamacpp": render_llamacpp,
}
