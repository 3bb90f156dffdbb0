"""`hafiza bench weights`: real worker processes on the default model (quick sizes), the JSON the issue asks for,
a worker that fails reported as an error row, bad options as one line; the llama.cpp side only where installed."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hafiza.bench import weights
from hafiza.bench.llamacpp import llama_import
from hafiza.models.loader import default_model_path

REQUIRED = ("model", "system", "weights", "decode_tok_s", "prefill_tok_s", "peak_rss_bytes", "load_s",
            "busy_decode_tok_s", "isa", "kernel")


def hafiza_cmd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hafiza", "bench", "weights", *args], capture_output=True,
                          text=True, timeout=900)


@pytest.mark.timeout(900)
def test_quick_run_writes_every_required_field(tmp_path: Path) -> None:
    systems = "hafiza,llama.cpp" if llama_import()[0] is not None else "hafiza"
    out = tmp_path / "weights.json"
    done = hafiza_cmd("--quick", "--systems", systems, "--isa", "native,avx2", "--profile", "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["bandwidth_GBps"] > 0
    expect = ["hafiza", "hafiza (avx2)"] + (["llama.cpp"] if "llama.cpp" in systems else [])
    assert [r["system"] for r in data["results"]] == expect
    for row in data["results"]:
        assert "error" not in row, row
        for field in REQUIRED:
            assert row[field] is not None and row[field] != "", (field, row)
        assert row["isa"] in ("avx2", "avx512", "default") and row["kernel"], row
        if row["system"].startswith("hafiza"):
            assert row["step_ms_matmul"] > 0 and row["step_ms_other"] > 0, row
            parts = row["step_ms_parts"]
            assert parts["step"] == pytest.approx(row["step_ms_matmul"] + row["step_ms_other"])
        else:
            assert row["step_ms_matmul"] is None and row["step_ms_other"] is None
        assert row["model"] == default_model_path().name
        assert row["peak_rss_bytes"] > 50 * 2**20 and row["load_s"] > 0
        assert row["bytes_read_per_token"] > 10 * 2**20
        assert row["decode_fraction_of_limit"] > 0
    assert data["results"][1]["isa"] == "avx2"
    assert "decode step by part" in done.stdout
    hafiza_row = data["results"][0]
    assert hafiza_row["weights"].startswith("auto (") and "int4" in hafiza_row["weights"]
    if "llama.cpp" in systems:
        assert data["results"][2]["weights"] == "gguf (Q4_1+Q8_0)"
    assert "memory read bandwidth" in done.stdout
    doc = weights.markdown(data)
    assert doc.count("\n") == 1 + len(data["results"]) and f"| {hafiza_row['model']} | hafiza |" in doc


def test_a_failing_worker_is_an_error_row_not_a_number(tmp_path: Path) -> None:
    bogus = tmp_path / "not-a-model.gguf"
    bogus.write_bytes(b"GGUF" + b"\0" * 64)
    res = weights.run_worker("hafiza", bogus, "auto", 16, 4, 1, timeout_s=300)
    assert "error" in res and "exit status" in res["error"]
    rows = weights.summarize([{"model": bogus.name, "system": "hafiza", **res}], bandwidth=10.0)
    assert rows[0]["error"] and rows[0]["decode_tok_s"] is None


@pytest.mark.parametrize(("args", "needle"), [
    (["--systems", "vllm"], "--systems"),
    (["--weights", "q3"], "--weights"),
    (["--isa", "sse2"], "--isa"),
    (["--models", "/nonexistent/x.gguf"], "no file"),
])
def test_bad_options_end_in_one_line(args: list[str], needle: str) -> None:
    done = hafiza_cmd(*args)
    assert done.returncode == 2
    assert needle in done.stderr and "Traceback" not in done.stderr


def test_gguf_bytes_per_token_counts_the_output_matrix() -> None:
    from gguf import GGUFReader

    path = default_model_path()
    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    expect = sum(tensors.values()) - (tensors["token_embd.weight"] if "output.weight" in tensors else 0)
    assert weights.gguf_bytes_per_token(path) == expect


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_the_spinner_stops_when_its_worker_is_killed() -> None:
    code = ("import time\nfrom hafiza.bench.weights_worker import spinning_core\n"
            "with spinning_core() as pid:\n    print(pid, flush=True)\n    time.sleep(600)\n")
    worker = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert worker.stdout is not None
    spinner = int(worker.stdout.readline())
    assert _running(spinner)
    worker.kill()
    worker.wait()
    deadline = time.monotonic() + 60
    while _running(spinner) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(spinner), f"spinner {spinner} outlived its worker"


def test_the_server_summary_states_the_ratio_or_why_there_is_none() -> None:
    ours = {"system": "hafiza serve (OpenAI API)", "aggregate_tok_s": 30.0}
    peer = {"system": "llama.cpp llama-server (16 parallel slots)", "slots": 16, "aggregate_tok_s": 12.0}
    server = {"config": {"sessions": 16}, "rows": [ours, peer]}
    assert weights.server_summary(server) == ("16 streams: hafiza serve 30.0 tok/s, llama-server (16 slots) 12.0 "
                                              "tok/s: 2.50x (target >= 3x, missed)")
    assert weights.server_summary(server | {"rows": [ours | {"aggregate_tok_s": 36.0}, peer]}).endswith(", met)")
    missing = {"system": "llama.cpp llama-server", "error": "no llama-server binary found"}
    assert weights.server_summary(server | {"rows": [ours, missing]}) == ("no llama-server figure: no llama-server "
                                                                          "binary found")
