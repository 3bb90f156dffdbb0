"""`hafiza bench weights-quality`: what each run-time weight format costs in perplexity against the exactly
dequantized fp32 model, on the same GGUF file and held-out texts (bench/texts/quality).

Targets: +1 % for a 4-bit file's formats, +0.2 % for a Q8_0 file. `--q8-file` also writes a Q8_0 copy of the
model (its weights requantized by gguf's own quantizer) so the Q8_0 -> int8 repack is measured on a pure Q8_0 file.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from hafiza.bench.common import write_json
from hafiza.bench.quality import TEXT_DIR, load_texts
from hafiza.bench.quality_runs import engine_config, run_text
from hafiza.engine import LLMEngine
from hafiza.models import load_model
from hafiza.models.loader import default_model_path

TARGET_PCT = {"4-bit": 1.0, "Q8_0": 0.2}


def write_q8_copy(src: Path, dst: Path) -> Path:
    """The same model with every 2-D tensor requantized to Q8_0 (metadata copied as it is)."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize, quantize

    reader = GGUFReader(str(src), "r")
    arch = reader.fields["general.architecture"].contents()
    w = GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        arr = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        if len(shape) == 2 and shape[1] % 32 == 0:
            w.add_tensor(t.name, quantize(arr, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(t.name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def perplexities(model: Path, mode: str, texts: list[tuple[str, list[int]]], chunk: int) -> dict[str, float]:
    """Per text: exp(mean next-token NLL) with weights in `mode` (fp32 KV, so only the weights differ)."""
    lm = load_model(model, dtype="fp32", weights=mode)
    engine = LLMEngine(lm, engine_config(lm, "fp32", None, None, chunk, max(len(ids) for _, ids in texts)))
    out = {}
    for name, ids in texts:
        run = run_text(engine, ids, [], 0)
        out[name] = math.exp(run.nll_sum / run.scored)
    out["_formats"] = lm.model.weights.formats()  # type: ignore[assignment]
    return out


def run(model: Path, modes: list[str], files: list[Path], tokens: int, chunk: int, file_class: str) -> dict[str, Any]:
    lm = load_model(model, dtype="fp32", weights="fp32")
    texts = load_texts(lm, files, tokens)
    del lm
    rows = []
    ref = perplexities(model, "fp32", texts, chunk)
    for mode in modes:
        t0 = time.perf_counter()
        got = perplexities(model, mode, texts, chunk)
        for name, _ in texts:
            delta = 100.0 * (got[name] / ref[name] - 1.0)
            target = TARGET_PCT[file_class] if mode == "auto" or (mode == "q4" and file_class == "4-bit") else None
            rows.append({"model": model.name, "file": file_class, "weights": mode, "formats": got["_formats"],
                         "text": name, "tokens": len(texts[[n for n, _ in texts].index(name)][1]),
                         "ppl_fp32": ref[name], "ppl": got[name], "delta_pct": delta, "target_pct": target,
                         "met": None if target is None else delta <= target})
        print(f"  {model.name} {mode}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return {"bench": "weights-quality", "chunk": chunk, "results": rows}


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("weights-quality")
    def weights_quality(
        json_path: Annotated[str | None, typer.Option("--json", help="Where to write the JSON results.")] = None,
        model: Annotated[str | None, typer.Option(help="GGUF file (default: SmolLM2-135M Q4_1).")] = None,
        modes: Annotated[str, typer.Option(help="Comma-separated --weights modes compared with fp32.")]
        = "auto,q4,q8",
        text: Annotated[list[str] | None, typer.Option(help="Text file (repeatable; default: bench/texts/quality).")
                        ] = None,
        tokens: Annotated[int, typer.Option(help="Tokens of each text evaluated.")] = 2048,
        chunk: Annotated[int, typer.Option(help="Prefill chunk (tokens) of the evaluation.")] = 512,
        q8_file: Annotated[bool, typer.Option(help="Also measure a Q8_0 copy of the model (written to /tmp).")]
        = True,
    ) -> None:
        """Perplexity of each weight format against the exactly dequantized fp32 weights of the same file."""
        path = Path(model) if model else default_model_path()
        files = [Path(t) for t in text] if text else sorted(TEXT_DIR.glob("*.txt"))
        mode_list = [m.strip() for m in modes.split(",") if m.strip()]
        data = run(path, mode_list, files, tokens, chunk, "4-bit")
        if q8_file:
            q8 = write_q8_copy(path, Path("/tmp") / f"{path.stem}.Q8_0-copy.gguf")
            data["results"] += run(q8, ["auto"], files, tokens, chunk, "Q8_0")["results"]
            q8.unlink()
        table = Table(title=f"Weight formats vs exact fp32 weights: perplexity, {tokens} tokens per text")
        for col in ("model", "weights", "text", "ppl fp32", "ppl", "delta", "target"):
            table.add_column(col)
        for r in data["results"]:
            target = "" if r["target_pct"] is None else f"<= +{r['target_pct']}% {'met' if r['met'] else 'MISSED'}"
            table.add_row(r["model"], r["weights"], r["text"], f"{r['ppl_fp32']:.3f}", f"{r['ppl']:.3f}",
                          f"{r['delta_pct']:+.2f}%", target)
        Console().print(table)
        print(f"wrote {write_json(data, json_path, 'weights_quality.json')}")
