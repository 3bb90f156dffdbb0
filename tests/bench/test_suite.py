"""`hafiza bench all`: benchmarks run as real subprocesses, failures reported (never faked), regions rendered from
real results (tests/bench/data/: JSON written by `hafiza bench all --quick`, long lists trimmed)."""

from __future__ import annotations

import json
from pathlib import Path

from hafiza.bench.markdown import Region
from hafiza.bench.suite import BENCHES, Bench, Outcome, Run, run_one, write_docs

DATA = Path(__file__).parent / "data"
PROSE = """# Benchmarks

Hand-written introduction.

## Engine core: KV cache vs recompute

Notes on the engine, kept as written.

## Server

| measure | value |
|---|---|
| written by hand | 42 |
"""


def outcome(name: str, data: dict | None, returncode: int = 0) -> Outcome:
    bench = next(b for b in BENCHES if b.name == name)
    out = Outcome(bench, bench.argv(Path(f"r/{name}.json"), Path(f"docs/bench_{name}.png"), True),
                  Path(f"r/{name}.json"), Path(f"r/{name}.log"), seconds=1.0, returncode=returncode, data=data)
    return out


def region(doc: str, name: str) -> str:
    return doc.split(f"<!-- bench:{name}:start -->")[1].split(f"<!-- bench:{name}:end -->")[0]


def test_every_benchmark_is_rendered_from_real_results(tmp_path: Path) -> None:
    (tmp_path / "BENCHMARKS.md").write_text(PROSE)
    outcomes = [outcome(b.name, json.loads((DATA / f"{b.name}.json").read_text())) for b in BENCHES]
    doc = write_docs(outcomes, tmp_path, quick=True, invocation="hafiza bench all --quick").read_text()
    assert doc.startswith(PROSE.split("## Server")[0].rstrip("\n"))
    assert "| written by hand | 42 |" in doc and "Notes on the engine, kept as written." in doc
    for b in BENCHES:
        body = region(doc, b.name)
        assert f"`hafiza {' '.join(b.command)} --json r/{b.name}.json" in body
        assert "AMD" in body or "cores" in body
        assert "Did not run" not in body and "could not be drawn" not in body, body
        assert "\n| " in body  # a table
    assert doc.index("<!-- bench:cache:start -->") < doc.index("## Server")
    assert doc.index("## Server") < doc.index("<!-- bench:serve:start -->")
    llama = json.loads((DATA / "llamacpp.json").read_text())
    decode = next(d for d in llama["decode"] if d["system"] == "llama.cpp")
    assert f"| {decode['decode_tokens_per_s']:.1f} |" in region(doc, "cache")
    assert "llama.cpp prompt cache (peer)" in region(doc, "prefix")
    assert "llama.cpp" in region(doc, "serve")
    for png in ("bench_cache.png", "bench_batch.png", "bench_serve.png", "bench_tiers.png", "bench_llamacpp.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
        assert f"]({png})" in doc
    summary = region(doc, "summary")
    assert "hafiza bench all --quick" in summary and summary.count("| ok |") == len(BENCHES)


def test_a_missing_llama_cpp_is_said_in_the_peer_tables(tmp_path: Path) -> None:
    reason = "llama-cpp-python is not installed (ModuleNotFoundError: No module named 'llama_cpp')"
    outcomes = [outcome(n, json.loads((DATA / f"{n}.json").read_text())) for n in ("cache", "prefix", "serve")]
    outcomes.append(outcome("llamacpp", {"available": False, "reason": reason}))
    doc = write_docs(outcomes, tmp_path, quick=False, invocation="hafiza bench all").read_text()
    for name in ("cache", "prefix", "serve"):
        assert f"not installed or not loadable: {reason}" in region(doc, name)
    assert f"**llama.cpp could not be measured**: {reason}" in region(doc, "llamacpp")


def test_a_benchmark_that_fails_or_hangs_is_reported(tmp_path: Path) -> None:
    broken = Bench("nope", ("bench", "nope"), (), (), Region("nope", "Nowhere"))
    lines: list[str] = []
    failed = run_one(broken, tmp_path, tmp_path, quick=False, timeout_s=300, echo=lines.append)
    assert failed.returncode not in (0, None) and not failed.ok
    assert "No such command" in (tmp_path / "nope.log").read_text()
    hung = run_one(Bench("slow", ("serve",), (), (), Region("slow", "Nowhere")), tmp_path, tmp_path,
                   quick=False, timeout_s=0.2, echo=lines.append)
    assert hung.timed_out and not hung.ok
    doc = write_docs([failed, hung], tmp_path, quick=False, invocation="hafiza bench all").read_text()
    assert "## Nowhere" in doc
    assert f"**Did not run**: exit status {failed.returncode}: `" in region(doc, "nope")
    assert "**Did not run**: timed out after" in region(doc, "slow")
    assert "**failed**" in region(doc, "summary")


def test_a_real_benchmark_runs_end_to_end(tmp_path: Path) -> None:
    tiny = Bench("memory", ("bench", "memory"), (), ("--requests", "2", "--max-len", "48"),
                 Region("memory", "Prefix caching, batching and memory"))
    done = run_one(tiny, tmp_path, tmp_path, quick=True, timeout_s=600, echo=lambda _: None)
    assert done.ok, done.log_tail
    assert done.data["requests"] == 2
    body = region(write_docs([done], tmp_path, quick=True, invocation="x").read_text(), "memory")
    assert f"| 2 | 48 | 16 | {done.data['paged_waste_pct']:.1f} % |" in body


def test_render_only_redraws_the_last_run(tmp_path: Path) -> None:
    for name in ("cache", "llamacpp"):
        (tmp_path / f"{name}.json").write_text((DATA / f"{name}.json").read_text())
    outcomes = [outcome("cache", json.loads((DATA / "cache.json").read_text())), outcome("llamacpp", None, 1)]
    outcomes[1].log_tail = ["RuntimeError: boom\n"]
    Run(outcomes, quick=True, invocation="hafiza bench all --quick", conditions="load average 0.1 on 2 cores",
        date="2026-01-02 03:04 UTC").save(tmp_path)
    run = Run.load(tmp_path)
    assert [o.ok for o in run.outcomes] == [True, False] and run.outcomes[0].data == outcomes[0].data
    doc = write_docs(run.outcomes, tmp_path, run.quick, run.invocation, run.conditions, run.date).read_text()
    assert "on 2026-01-02 03:04 UTC" in region(doc, "cache") and "load average 0.1 on 2 cores" in doc
    assert "**Did not run**: exit status 1: `RuntimeError: boom`" in region(doc, "llamacpp")
    assert "`hafiza bench llamacpp` did not run or failed" in region(doc, "cache")


def test_the_regions_name_the_weights_hafiza_ran_with(tmp_path: Path) -> None:
    data = {n: json.loads((DATA / f"{n}.json").read_text()) for n in ("batch", "serve", "llamacpp")}
    data["batch"]["weights"] = "fp32 (fp32)"
    data["serve"]["config"]["weights"] = "fp32"
    data["llamacpp"]["hafiza_weights"] = "auto (int4+int8)"
    doc = write_docs([outcome(n, d) for n, d in data.items()], tmp_path, quick=True, invocation="x").read_text()
    assert "Weights: fp32 (fp32)." in region(doc, "batch")
    assert "hafiza serve ran with `--weights fp32`." in region(doc, "serve")
    assert "hafiza with weights auto (int4+int8))" in region(doc, "llamacpp")
    assert "dequantised" not in region(doc, "llamacpp")
