"""`hafiza bench quality` on a tiny model through LLMEngine: rows, JSON fields, table, plot and the command's
registration."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from hafiza.bench import quality
from hafiza.bench.quality_runs import agreement, greedy_points, token_match
from hafiza.errors import HafizaError
from hafiza.models import LoadedModel

FIELDS = {"format", "policy", "perplexity", "ppl_increase_pct", "greedy_agreement", "bytes_per_token"}


def test_rows_cover_formats_and_policies(tiny_llama: LoadedModel) -> None:
    texts = [("a", [(3 * i + 1) % 97 for i in range(96)]), ("b", [(5 * i + 2) % 97 for i in range(80)])]
    setup = quality.Setup(tokens=96, chunk=32, points=2, gen_tokens=4, budget_tokens=80)
    rows = quality.hafiza_rows(tiny_llama, texts, ["fp32", "bf16", "int8", "int4"], ["streaming", "h2o"],
                               setup)
    assert [(r["format"], r["policy"]) for r in rows] == [
        ("bf16", None), ("fp32", None), ("int8", None), ("int4", None), ("bf16", "streaming"), ("bf16", "h2o")]
    assert all(set(r) >= FIELDS for r in rows)
    base = rows[0]
    assert base["ppl_increase_pct"] == 0.0 and base["greedy_agreement"] == 1.0 and base["greedy_points"] == 4
    assert rows[2]["target_pct"] == 0.5 and isinstance(rows[2]["target_met"], bool)
    assert rows[4]["evicted_tokens"] > 0 and rows[4]["budget_tokens"] == 80
    assert rows[3]["bytes_per_token"] < rows[2]["bytes_per_token"] < base["bytes_per_token"]
    data = {"model": "tiny", "baseline": "bf16", "chunk": 32, "budget_tokens": 80, "texts": texts,
            "results": [*rows, {"system": "transformers", "format": "hf-x", "policy": None, "error": "no"}]}
    quality.print_table(data)


def test_plot_writes_png(tmp_path: Path) -> None:
    data = {"model": "tiny", "baseline": "bf16", "results": [
        {"system": "hafiza", "format": "int8", "policy": None, "perplexity": 2.0, "ppl_increase_pct": 0.1,
         "bytes_per_token": 100.0},
        {"system": "transformers", "format": "hf-x", "policy": None, "error": "did not install"}]}
    quality.plot(data, tmp_path / "q.png")
    assert (tmp_path / "q.png").read_bytes()[:4] == b"\x89PNG"


def test_missing_texts_are_a_clear_error(tiny_llama: LoadedModel, tmp_path: Path) -> None:
    with pytest.raises(HafizaError, match="no quality texts"):
        quality.load_texts(tiny_llama, [], 10)
    with pytest.raises(HafizaError, match="not found"):
        quality.load_texts(tiny_llama, [tmp_path / "none.txt"], 10)


def test_points_and_agreement() -> None:
    assert greedy_points(4096, 64, 3) == [1344, 2752, 4096]
    assert greedy_points(100, 64, 2) == [64, 100]
    assert agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    assert token_match([1, 2, 3, 4], [1, 2, 9, 4]) == 0.75


def test_register_adds_the_quality_command() -> None:
    app = typer.Typer()
    quality.register(app)
    assert [c.name for c in app.registered_commands] == ["quality"]


def test_shipped_texts_are_long_enough() -> None:
    files = sorted(quality.TEXT_DIR.glob("*.txt"))
    assert len(files) >= 3
    assert all(len(f.read_text(encoding="utf-8")) > 20_000 for f in files)
