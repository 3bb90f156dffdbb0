"""llama-cpp-python as a benchmark peer: import it, open a GGUF, time greedy generation. Imports no torch, so a
process measuring llama.cpp's peak RSS (`hafiza bench weights`' worker) holds llama.cpp's memory only."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def llama_import() -> tuple[Any, str | None]:
    """(the llama_cpp module, None), or (None, why it cannot be used)."""
    try:
        import llama_cpp
    except Exception as exc:  # ImportError, or a shared library that fails to load
        return None, (f"llama-cpp-python is not installed ({type(exc).__name__}: {exc}); "
                      "install the peers with `pip install '.[peers]'`")
    return llama_cpp, None


def open_llama(llama_cpp: Any, path: Path, n_ctx: int, threads: int) -> Any:
    """A quiet `llama_cpp.Llama` on `path` with `threads` threads for both prefill and decode."""
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_threads=threads,
                           n_threads_batch=threads, verbose=False)


def llama_generate(llm: Any, ids: list[int], new_tokens: int) -> tuple[float, float]:
    """(total seconds, seconds to the first token) for greedy tokens after a fresh prefill of `ids`."""
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    token = llm.sample(temp=0.0)
    first = time.perf_counter()
    for _ in range(new_tokens - 1):
        llm.eval([token])
        token = llm.sample(temp=0.0)
    return time.perf_counter() - t0, first - t0


def llama_ttft(llm: Any, ids: list[int]) -> tuple[float, int]:
    """Seconds to the first token of a completion of `ids` (llama.cpp reuses the prefix it still holds), and
    how many prompt tokens it reused."""
    held = list(llm.input_ids[: llm.n_tokens])
    reused = next((i for i, (a, b) in enumerate(zip(held, ids, strict=False)) if a != b), min(len(held), len(ids)))
    t0 = time.perf_counter()
    llm.create_completion(ids, max_tokens=1, temperature=0.0)
    return time.perf_counter() - t0, min(reused, len(ids) - 1)
