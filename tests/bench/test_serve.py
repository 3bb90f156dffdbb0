"""`hafiza bench serve` and the server part of `bench llamacpp`/`bench weights`: the hafiza server they start gets
the benchmark's `--weights` (a real server under a tiny real load), and a bad `--weights` is one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hafiza.bench import llamacpp
from hafiza.bench import serve as serve_bench
from hafiza.models.loader import default_model_path


def test_the_server_command_carries_weights_before_the_extra_arguments() -> None:
    cfg = serve_bench.Config(weights="fp32", server_args=["--kv-dtype", "fp16"])
    cmd = serve_bench.server_command(cfg, 8123)
    assert cmd[1:4] == ["-m", "hafiza", "serve"]
    i = cmd.index("--weights")
    assert cmd[i + 1] == "fp32" and cmd[-2:] == ["--kv-dtype", "fp16"] and i < len(cmd) - 2
    assert cmd[cmd.index("--port") + 1] == "8123"


@pytest.mark.timeout(900)
def test_the_server_load_starts_hafiza_with_the_benchmarks_weights(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """bench_servers used to rebuild the config and drop everything but the load's sizes; each server's figures
    are printed as soon as its load is done."""
    cfg = serve_bench.Config(sessions=2, turns=1, max_tokens=2, system_words=20, api="openai", weights="q8")
    out = llamacpp.bench_servers(default_model_path(), cfg, [], None, 2, 1, tmp_path)
    [row] = out["rows"]
    assert "error" not in row, row
    assert "--weights q8" in row["command"] and row["weights"] == "q8"
    assert row["requests"] == 2 and row["output_tokens"] >= 2 and row["aggregate_tok_s"] > 0
    assert f"hafiza serve (OpenAI API): {row['aggregate_tok_s']:.2f} output tok/s" in capsys.readouterr().out


@pytest.mark.parametrize("bench", ["serve", "llamacpp"])
def test_a_bad_weights_option_is_one_line(bench: str) -> None:
    done = subprocess.run([sys.executable, "-m", "hafiza", "bench", bench, "--weights", "q3"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2
    assert "q3" in done.stderr and "Traceback" not in done.stderr
