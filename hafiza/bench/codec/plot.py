"""The Pareto plot: bits/value against one-thread decode MB/s for the bf16 KV coders and peers."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pareto_plot(results: dict[str, Any], path: Path) -> None:
    """A small PNG: one point per coder on bf16 KV, peers in grey, the Pareto front drawn as a step line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [c for c in results["coders"] if c["kv_dtype"] == "bf16"]
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=90)
    for c in rows:
        peer = c["kind"] == "peer"
        ax.scatter(c["decode_MBps"], c["bits_per_value"], color="grey" if peer else "tab:blue",
                   marker="s" if peer else "o", zorder=3)
        ax.annotate(c["coder"].replace("predictive+", "pred+"), (c["decode_MBps"], c["bits_per_value"]),
                    fontsize=7, xytext=(4, 3), textcoords="offset points")
    front, best = [], float("inf")
    for c in sorted(rows, key=lambda c: -c["decode_MBps"]):
        if c["bits_per_value"] < best:
            best = c["bits_per_value"]
            front.append((c["decode_MBps"], best))
    if front:
        xs, ys = zip(*front, strict=True)
        ax.step(xs, ys, where="post", color="tab:orange", alpha=0.6, label="Pareto front")
    h = results.get("entropy0", {}).get("bf16", {}).get("all")
    if h:
        ax.axhline(h, color="tab:red", ls="--", lw=1, label=f"zero-order entropy {h:.2f}")
    ax.set_xscale("log")
    ax.set_xlabel("decode MB/s, one thread (log)")
    ax.set_ylabel("bits per value (bf16 KV, K+V)")
    ax.set_title(f"hafiza lossless KV codec, {results.get('tokens')} tokens x {len(results.get('texts', []))} texts",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
