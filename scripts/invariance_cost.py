"""Cost of batch invariance: median step times of a 512-token prefill, a decode at 512 tokens of context and a
16-sequence decode, with the attention and fp32 matmul of commit REV (default: the one before the batch-invariant
kernels, SDPA + F.linear) against the current ones, interleaved. Usage: python scripts/invariance_cost.py [REPS] [REV]
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

import hafiza.models.linear as linear
import hafiza.models.llama as llama
from hafiza.engine import EngineConfig, LLMEngine, SamplingParams
from hafiza.models import load_model

ROOT = Path(__file__).resolve().parents[1]


def old_module(rev: str, name: str, tmp: Path) -> ModuleType:
    """hafiza/models/<name>.py as it was at `rev`, imported under another name."""
    text = subprocess.run(["git", "show", f"{rev}:hafiza/models/{name}.py"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout
    path = tmp / f"old_{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"old_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def step_times(model: object, prompts: list[list[int]], max_tokens: int) -> list[float]:
    eng = LLMEngine(model, EngineConfig(kv_memory="256MiB", enable_prefix_caching=False))
    for p in prompts:
        eng.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    times = []
    while eng.has_unfinished():
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    rev = sys.argv[2] if len(sys.argv) > 2 else "647c433~1"
    tmp = Path(tempfile.mkdtemp())
    old_attn, old_llama = old_module(rev, "attention", tmp), old_module(rev, "llama", tmp)
    new_attn, new_linear = llama.paged_attention, linear.cpu_fp32_linear
    model = load_model(dtype="fp32", device="cpu")
    ids = model.tokenizer.encode((ROOT / "bench/texts/en_declaration_gettysburg.txt").read_text())
    res: dict[str, dict[str, list[float]]] = {k: {"prefill512": [], "decode1@512": [], "decode16@32": []}
                                              for k in ("old", "new")}
    for _ in range(reps):
        for kind in ("old", "new"):
            llama.paged_attention = new_attn if kind == "new" else old_attn.paged_attention
            linear.cpu_fp32_linear = new_linear if kind == "new" else old_llama.cpu_fp32_linear
            t = step_times(model, [ids[:512]], 17)
            res[kind]["prefill512"].append(t[0])
            res[kind]["decode1@512"] += t[1:]
            res[kind]["decode16@32"] += step_times(model, [ids[i * 32 : i * 32 + 32] for i in range(16)], 17)[1:]
    medians = {k: {m: round(statistics.median(v) * 1e3, 1) for m, v in d.items()} for k, d in res.items()}
    print(json.dumps({"median_step_ms": medians, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
