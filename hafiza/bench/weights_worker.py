"""One system on one GGUF in a process of its own, for `hafiza bench weights`: load time, prefill and decode speed,
decode while another process spins on one core, and the process's peak RSS, printed as one JSON line.

`python -m hafiza.bench.weights_worker SYSTEM MODEL WEIGHTS PREFILL NEW_TOKENS THREADS` (SYSTEM: hafiza or
llama.cpp). Both systems get the same token ids: a prompt of PREFILL tokens for prefill, then NEW_TOKENS greedy
tokens after a 128-token prompt for decode (twice: quiet, then with the spinner running).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hafiza.engine import LLMEngine
    from hafiza.models import LoadedModel

DECODE_CONTEXT = 128
# Spins until its parent is gone (a killed worker leaves no spinner behind).
SPIN = ("import os\nparent = os.getppid()\nprint('spinning', flush=True)\nwhile os.getppid() == parent:\n"
        "    for _ in range(1_000_000):\n        pass\n")


@contextmanager
def spinning_core() -> Iterator[int]:
    """A separate process keeping one core busy for the duration (started when it says so); yields its pid."""
    proc = subprocess.Popen([sys.executable, "-c", SPIN], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def context_tokens(prefill: int, new_tokens: int) -> int:
    """The context both systems are sized for: the longest request a worker makes, plus 64 (llama.cpp's n_ctx,
    hafiza's KV pool, as `hafiza generate` sizes it)."""
    return max(prefill, DECODE_CONTEXT) + new_tokens + 64


def prompt_ids(tokenize: Callable[[str], list[int]], n: int) -> list[int]:
    """`n` token ids of plain English prose (the same text for both systems, tokenized by the model's tokenizer)."""
    text = ("A transformer keeps the keys and values of every token it has read, so that each new token attends to "
            "the whole history without recomputing it. This memory grows with the context, one block at a time. ")
    ids: list[int] = []
    while len(ids) < n:
        ids = tokenize(text * (n // 10 + 2))
        text += text
    return ids[:n]


def peak_rss_bytes() -> int:
    """This process's own peak RSS. Not getrusage's ru_maxrss: Linux carries it across fork and exec, so a worker
    started by a parent that had touched its 1 GiB bandwidth buffer reported the parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux; macOS has no /proc


def weights_label(loaded: LoadedModel) -> str:
    """The mode asked for and the formats it gave, largest first: `auto (int4+int8)`."""
    formats = loaded.model.weights.formats()
    return f"{loaded.weights} ({'+'.join(sorted(formats, key=lambda k: -formats[k]))})"


def run_hafiza(model: Path, weights: str, prefill: int, new_tokens: int) -> dict[str, Any]:
    from hafiza.engine import EngineConfig, LLMEngine, SamplingParams
    from hafiza.engine.engine import kv_memory_for_tokens
    from hafiza.models import load_model
    from hafiza.models.kernel_choice import cpu_kernel

    t0 = time.perf_counter()
    loaded = load_model(model, device="cpu", weights=weights)
    load_s = time.perf_counter() - t0
    config = EngineConfig(enable_prefix_caching=False, max_num_batched_tokens=max(2048, prefill))
    config.kv_memory = kv_memory_for_tokens(loaded, config, context_tokens(prefill, new_tokens))
    engine = LLMEngine(loaded, config)

    def timed(ids: list[int], n: int) -> tuple[float, float]:
        """(seconds to the first token, seconds from it to the last) for `n` greedy tokens after `ids`."""
        engine.add_request(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        start, first = time.perf_counter(), None
        while engine.has_unfinished():
            for out in engine.step():
                if out.new_token_ids and first is None:
                    first = time.perf_counter()
        end = time.perf_counter()
        return (first or end) - start, end - (first or end)

    tokenize = loaded.tokenizer.encode
    timed(prompt_ids(tokenize, 16), 4)  # warm-up
    prefill_s, _ = timed(prompt_ids(tokenize, prefill), 1)
    decode_ids = prompt_ids(tokenize, DECODE_CONTEXT)
    decode_s = timed(decode_ids, new_tokens)[1]
    with spinning_core():
        busy_s = timed(decode_ids, new_tokens)[1]
    parts = profiled_decode(engine, loaded, decode_ids, new_tokens)
    read = sum(lin.nbytes for lin in loaded.model.weights.linears())
    return {"weights": weights_label(loaded), "weight_formats": loaded.model.weights.formats(), "load_s": load_s,
            "prefill_tok_s": prefill / prefill_s, "decode_tok_s": (new_tokens - 1) / decode_s,
            "busy_decode_tok_s": (new_tokens - 1) / busy_s, "bytes_read_per_token": read,
            "isa": torch_isa(), "kernel": cpu_kernel(), "step_ms_matmul": parts["matmul"],
            "step_ms_other": parts["step"] - parts["matmul"], "step_ms_parts": parts}


def torch_isa() -> str:
    """The CPU capability torch's kernels run with here (ATEN_CPU_CAPABILITY can lower it), in lower case."""
    import torch

    return torch.backends.cpu.get_cpu_capability().lower()


def profiled_decode(engine: LLMEngine, loaded: LoadedModel, ids: list[int], new_tokens: int) -> dict[str, float]:
    """One more greedy decode of `new_tokens` after `ids` with the model's parts timed (bench/step_profile.py):
    milliseconds per decode step of each part; the prefill step is not counted."""
    from hafiza.bench.step_profile import step_parts_ms, timed_parts
    from hafiza.engine import SamplingParams

    engine.add_request(ids, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    with timed_parts(loaded.model) as clock:
        while not any(out.new_token_ids for out in engine.step()):
            pass
        clock.seconds.clear()
        start, steps = time.perf_counter(), 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        return step_parts_ms(clock, time.perf_counter() - start, steps)


def run_llamacpp(model: Path, prefill: int, new_tokens: int, threads: int) -> dict[str, Any]:
    from hafiza.bench.llama_peer import llama_generate, llama_import, open_llama

    llama_cpp, reason = llama_import()
    if llama_cpp is None:
        return {"error": reason}
    t0 = time.perf_counter()
    llm = open_llama(llama_cpp, model, context_tokens(prefill, new_tokens), threads)
    load_s = time.perf_counter() - t0

    def tokenize(text: str) -> list[int]:
        return llm.tokenize(text.encode(), add_bos=False)

    llama_generate(llm, prompt_ids(tokenize, 16), 4)  # warm-up
    _, prefill_s = llama_generate(llm, prompt_ids(tokenize, prefill), 1)
    decode_ids = prompt_ids(tokenize, DECODE_CONTEXT)
    total, first = llama_generate(llm, decode_ids, new_tokens)
    with spinning_core():
        busy_total, busy_first = llama_generate(llm, decode_ids, new_tokens)
    return {"weights": "gguf", "load_s": load_s, "prefill_tok_s": prefill / prefill_s,
            "decode_tok_s": (new_tokens - 1) / (total - first),
            "busy_decode_tok_s": (new_tokens - 1) / (busy_total - busy_first), "version": llama_cpp.__version__,
            "isa": llama_isa(llama_cpp), "kernel": "ggml (llama.cpp)", "step_ms_matmul": None, "step_ms_other": None}


def llama_isa(llama_cpp: Any) -> str:
    """The widest x86 vector extension llama.cpp's build reports (its system info), in lower case."""
    info = llama_cpp.llama_print_system_info().decode()
    return next((isa for isa in ("avx512", "avx2", "avx") if f"{isa.upper()} = 1" in info), "other")


def main(argv: list[str]) -> None:
    system, model, weights, prefill, new_tokens, threads = argv
    path = Path(model)
    if system == "hafiza":
        res = run_hafiza(path, weights, int(prefill), int(new_tokens))
    elif system == "llama.cpp":
        res = run_llamacpp(path, int(prefill), int(new_tokens), int(threads))
    else:
        raise SystemExit(f"unknown system {system!r}: hafiza or llama.cpp")
    print(json.dumps({"system": system, "peak_rss_bytes": peak_rss_bytes(), **res}), flush=True)


if __name__ == "__main__":
    from hafiza.threads import openmp_defaults

    openmp_defaults()  # before torch loads, as `hafiza.cli.main` does; a no-op when the parent chose for it
    main(sys.argv[1:])
