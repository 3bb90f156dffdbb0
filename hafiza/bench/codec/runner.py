"""Run the codec benchmark: real KV of the default model over texts, every selected coder and peer, one
thread, results aggregated over the texts."""

from __future__ import annotations

import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hafiza.bench.codec import peers
from hafiza.bench.codec.measure import Measurement, entropy0, measure_bytes, measure_codec
from hafiza.bench.codec.quantize import to_fp8, to_int8
from hafiza.codec import CodecContext
from hafiza.codec.coders.fast import warm_up as fast_warm_up
from hafiza.codec.formats import tensor_bits
from hafiza.codec.predictors.speculative import SpeculativePredictor
from hafiza.errors import HafizaError
from hafiza.models.capture import compute_kv

TEXTS_DIR = Path("bench/texts")  # relative to the working directory, like every benchmark's inputs
SPECULATIVE = {
    "spec-bf16-mixed": ("bf16-mixed", 0),
    "spec-bf16": ("bf16", 0),
    "spec-int8": ("int8", 0),
    "spec-exact6-bf16-mixed": ("bf16-mixed", 6),
}
HAFIZA = ["raw", "zstd", "planes", "fast", "exponent", "previous-token", *SPECULATIVE]
PEERS = ["zstd-3", "zstd-19", "shuffle-zstd-19", "zipnn"]
ALL = HAFIZA + PEERS
ZIPNN_DTYPES = {torch.bfloat16: "bfloat16"}


def default_texts() -> list[Path]:
    return sorted(TEXTS_DIR.glob("*.txt"))


def _label(name: str) -> str:
    if name in SPECULATIVE:
        variant, exact = SPECULATIVE[name]
        return f"predictive+speculative({variant}{f',exact{exact}' if exact else ''})"
    return {"previous-token": "predictive+previous-token"}.get(name, name)


class _Predictors:
    """One SpeculativePredictor per variant for encoding, and a fresh one per text to prove the decode."""

    def __init__(self, model: Any, grid: int = 1) -> None:
        self.model, self.grid, self.encoders, self.fresh = model, grid, {}, {}

    def encoder(self, name: str) -> SpeculativePredictor:
        if name not in self.encoders:
            self.encoders[name] = SpeculativePredictor(self.model, *SPECULATIVE[name], grid=self.grid)
        return self.encoders[name]

    def new_text(self) -> None:
        self.fresh = {}

    def decoder(self, name: str) -> SpeculativePredictor:
        if name not in self.fresh:
            self.fresh[name] = SpeculativePredictor(self.model, *SPECULATIVE[name], grid=self.grid)
        return self.fresh[name]


def _measure(name: str, kv: dict[str, torch.Tensor], ids: list[int], preds: _Predictors) -> Measurement | None:
    dtype = next(iter(kv.values())).dtype
    nbytes = next(iter(kv.values())).element_size()
    if name in ("raw", "zstd", "planes", "fast", "exponent"):
        return measure_codec(name, kv, lambda role: CodecContext(coder=name))
    if name == "previous-token":
        return measure_codec(_label(name), kv, lambda role: CodecContext(coder="predictive",
                                                                        predictor="previous-token"))
    if name in SPECULATIVE:
        if dtype == torch.int8:
            return None
        enc = preds.encoder(name)
        enc._memo = None

        def ctx(role: str, p: SpeculativePredictor = enc) -> CodecContext:
            return CodecContext(coder="predictive", predictor=p, token_ids=ids, role=role)

        m = measure_codec(_label(name), kv, ctx, lambda role: ctx(role, preds.decoder(name)))
        m.predictor_s = enc.last_seconds
        return m
    if name.startswith("zstd-"):
        return measure_bytes(name, kv, *peers.zstd_raw(int(name.split("-")[1])))
    if name == "shuffle-zstd-19":
        return measure_bytes(name, kv, *peers.zstd_shuffled(19, nbytes))
    if name == "zipnn" and dtype in ZIPNN_DTYPES:
        codec = peers.zipnn(ZIPNN_DTYPES[dtype])
        return measure_bytes(name, kv, *codec) if codec else None
    return None


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    def run(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"nproc": run(["nproc"]), "lscpu": run(["lscpu"]).splitlines()[:12], "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads()}


def run(texts: list[Path], tokens: int, coders: list[str], quantized: bool = True, grid: int = 1,
        progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure every coder in `coders` on each text's first `tokens` tokens; one torch thread; the speculative
    predictors round their prediction to `grid` ordered steps."""
    unknown = [c for c in coders if c not in ALL]
    if unknown:
        raise HafizaError(f"unknown coder(s) {', '.join(unknown)}: choose from {', '.join(ALL)}")
    for t in texts:
        if not t.is_file():
            raise HafizaError(f"text file not found: {t}")
    from hafiza.models import load_model

    torch.set_num_threads(1)
    if "fast" in coders:
        fast_warm_up()  # its compiled decode kernel is loaded before timing, as the store does when it starts
    lm = load_model(dtype="fp32", device="cpu", weights="fp32")
    preds = _Predictors(lm, grid)
    measurements: list[tuple[str, Measurement]] = []
    text_info, entropy = [], {}
    for path in texts:
        ids = lm.tokenizer.encode(path.read_text(encoding="utf-8"))[:tokens]
        start = time.process_time()
        k, v = compute_kv(lm.model, ids, kv_dtype=torch.bfloat16)
        prefill_s = time.process_time() - start
        text_info.append({"text": path.name, "tokens": len(ids), "prefill_s": prefill_s})
        progress(f"{path.name}: {len(ids)} tokens, fp32 prefill {prefill_s:.2f} CPU s (1 thread)")
        preds.new_text()
        sets = {"bf16": {"k": k, "v": v}}
        if quantized:
            sets["fp8_e4m3"] = {r: to_fp8(x) for r, x in sets["bf16"].items()}
            sets["int8"] = {r: to_int8(x) for r, x in sets["bf16"].items()}
        for dname, kv in sets.items():
            h = {r: entropy0(tensor_bits(x)) for r, x in kv.items()}
            h["all"] = entropy0(tensor_bits(torch.stack([kv["k"], kv["v"]])))
            for key, val in h.items():
                entropy.setdefault(dname, {}).setdefault(key, []).append((val, kv["k"].numel()))
            for name in coders:
                if dname != "bf16" and name in ("zstd-19", "shuffle-zstd-19", "spec-bf16", "spec-int8",
                                                "spec-exact6-bf16-mixed"):
                    continue
                m = _measure(name, kv, ids, preds)
                if m is None:
                    continue
                m.kv_dtype = dname
                measurements.append((path.name, m))
                progress(f"  {dname:8s} {m.label:45s} {_bits(m):6.3f} bits/value  lossless={m.lossless}")
    return {"tokens": tokens, "grid": grid, "texts": text_info, "machine": machine(),
            "model": {"name": lm.name, "fingerprint": lm.fingerprint, "compute": "fp32", "kv": "bf16"},
            "entropy0": {d: {r: sum(a * b for a, b in v) / sum(b for _, b in v) for r, v in rs.items()}
                         for d, rs in entropy.items()},
            "coders": aggregate(measurements, sum(t["prefill_s"] for t in text_info))}


def _bits(m: Measurement, roles: tuple[str, ...] = ("k", "v")) -> float:
    return 8 * sum(m.coded_bytes[r] for r in roles) / sum(m.values[r] for r in roles)


def aggregate(measurements: list[tuple[str, Measurement]], prefill_s: float) -> list[dict[str, Any]]:
    """One entry per (coder, KV dtype): bits/value over all texts, one-thread MB/s, predictor cost."""
    groups: dict[tuple[str, str], list[tuple[str, Measurement]]] = {}
    for text, m in measurements:
        groups.setdefault((m.label, m.kv_dtype), []).append((text, m))
    out = []
    for (label, dname), items in groups.items():
        ms = [m for _, m in items]

        def total(attr: str, roles: tuple[str, ...] = ("k", "v"), ms: list[Measurement] = ms) -> float:
            return sum(getattr(m, attr)[r] for m in ms for r in roles)

        raw = total("raw_bytes")
        pred_s = sum(m.predictor_s for m in ms)
        entry = {
            "coder": label, "kind": ms[0].kind, "kv_dtype": dname,
            "bits_per_value": 8 * total("coded_bytes") / total("values"),
            "bits_k": 8 * total("coded_bytes", ("k",)) / total("values", ("k",)),
            "bits_v": 8 * total("coded_bytes", ("v",)) / total("values", ("v",)),
            "encode_MBps": raw / total("encode_s") / 1e6,
            "decode_MBps": raw / total("decode_s") / 1e6,
            "lossless": all(m.lossless for m in ms),
            "per_text": {t: {"bits_per_value": _bits(m), "bits_k": _bits(m, ("k",)), "bits_v": _bits(m, ("v",))}
                         for t, m in items},
        }
        if pred_s:
            entry["predictor_s"] = pred_s
            entry["predictor_cost"] = pred_s / prefill_s
            entry["decode_MBps_with_predictor"] = raw / (total("decode_s") + pred_s) / 1e6
        out.append(entry)
    return out
