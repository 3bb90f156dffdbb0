"""`hafiza bench speculative` on a tiny workload size: every field of its JSON results, and hafiza's ngram and
draft-model output identical to plain decoding (no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from hafiza.bench.common import write_json
from hafiza.bench.markdown import replace_region
from hafiza.bench.speculative import REGION, WORKLOADS, Settings, edit_source, json_document, markdown, run_bench
from hafiza.models import LoadedModel

FIELDS = {"model", "system", "method", "workload", "tok_s", "acceptance_rate", "mean_accepted_len", "identical"}


def test_workload_sources_are_deterministic() -> None:
    assert edit_source(300) == edit_source(300)
    assert len(edit_source(300).splitlines()) == 300
    assert json.loads(json_document(3))["products"][2]["id"] == 1002


def test_tiny_run_writes_every_field(default_model: LoadedModel, tiny_llama: LoadedModel, tmp_path: Path) -> None:
    settings = Settings(max_tokens=12, repeats=1, edit_lines=40, json_items=2)
    data = run_bench(default_model, settings, draft=tiny_llama)
    out = write_json(data, tmp_path / "speculative.json", "speculative.json")
    results = json.loads(out.read_text())["results"]
    systems = {(r["system"], r["method"]) for r in results}
    assert systems >= {("hafiza", "none"), ("hafiza", "ngram"), ("hafiza", "draft")}
    assert {r["workload"] for r in results} == set(WORKLOADS)
    for r in results:
        assert r.keys() >= FIELDS
        assert r["model"] == default_model.path.name
        assert r["tok_s"] > 0
    ngram = [r for r in results if r["method"] in ("ngram", "draft")]
    assert all(r["identical"] for r in ngram)
    assert all(0.0 <= r["acceptance_rate"] <= 1.0 for r in ngram if r["acceptance_rate"] is not None)
    doc = replace_region("# Benchmarks\n", REGION, markdown(data))
    assert "## Speculative decoding" in doc and "| edit |" in doc
