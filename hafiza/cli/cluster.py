"""`hafiza cluster`: redis-server, N `hafiza serve` workers publishing KV events, and vllm-router (kv_aware) in
front of them, all on loopback; one URL to use, Ctrl-C stops everything."""

from __future__ import annotations

import signal
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from hafiza.cli import app
from hafiza.cluster import Cluster, Layout
from hafiza.errors import HafizaError


@app.command()
def cluster(
    workers: Annotated[int, typer.Option(help="How many `hafiza serve` instances (one thread each).")] = 2,
    policy: Annotated[str, typer.Option(help="vllm-router policy: kv_aware, cache_aware or round_robin.")
                      ] = "kv_aware",
    model: Annotated[str | None, typer.Option(help="GGUF file or model directory (default: SmolLM2-135M).")] = None,
    kv_memory: Annotated[str, typer.Option(help="Each worker's KV pool size.")] = "auto",
) -> None:
    """Try hafiza behind vllm-router on this machine: prints the one URL to use; Ctrl-C stops everything."""
    if workers < 1:
        raise HafizaError("--workers must be at least 1")
    if policy not in ("kv_aware", "cache_aware", "round_robin"):
        raise HafizaError(f"--policy must be kv_aware, cache_aware or round_robin, got {policy!r}")
    extra = ("--kv-memory", kv_memory, *(("--model", model) if model else ()))
    layout = Layout.on_free_ports(workers, policy, extra)
    log_dir = Path(tempfile.mkdtemp(prefix="hafiza-cluster-"))
    typer.echo(f"starting redis-server, {workers} workers and vllm-router ({policy}); logs in {log_dir}")
    running = Cluster(layout, log_dir).start()
    typer.echo(f"\n  {layout.url}   (OpenAI and Anthropic APIs; workers: "
               f"{', '.join(w.url for w in layout.workers)})\n\nCtrl-C stops everything.")
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        running.stop()
