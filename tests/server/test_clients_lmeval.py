"""lm-eval's `local-completions` model against /v1/completions (echo + logprobs loglikelihood requests), with
the server's own tokenizer (`tokenizer_backend=remote`: /tokenizer_info, /tokenize, /detokenize) and a tiny task
shipped in the repo: nothing comes from a hub."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.server.conftest import Server

pytestmark = pytest.mark.slow
TASK_DIR = Path(__file__).parent / "lmeval"


def test_local_completions_gives_a_finite_accuracy(server: Server, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    import lm_eval
    from lm_eval.tasks import TaskManager

    task = (TASK_DIR / "capitals.yaml").read_text().replace("DATA_FILE", str(TASK_DIR / "capitals.jsonl"))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "capitals.yaml").write_text(task)
    args = (f"base_url={server.url}/v1/completions,model={server.model},tokenizer_backend=remote,"
            "num_concurrent=1,max_retries=1")
    results = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["hafiza_capitals"],
                                      task_manager=TaskManager(include_path=str(tmp_path / "tasks")))
    acc = results["results"]["hafiza_capitals"]["acc,none"]
    assert math.isfinite(acc) and 0.0 <= acc <= 1.0
    assert results["n-samples"]["hafiza_capitals"]["effective"] == 6
