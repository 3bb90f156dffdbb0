"""Greedy answer and decode speed of one GGUF under the CPU kernel HAFIZA_CPU_KERNEL names (docs/WEIGHTS.md,
"ggml's integer-dot kernels"): load time, the answer to "What is the capital of France?", and the median
ms per decode step of 32 tokens after a 128-token prompt (three runs).

    for k in torch ggml torch ggml; do HAFIZA_CPU_KERNEL=$k OMP_NUM_THREADS=1 .venv/bin/python \\
        scripts/cpu_kernel_decode.py; done
"""

from __future__ import annotations

import statistics
import sys
import time

from hafiza.engine import EngineConfig, LLMEngine, SamplingParams
from hafiza.models import load_model
from hafiza.models.kernel_choice import describe


def main(path: str | None) -> None:
    t = time.perf_counter()
    loaded = load_model(path, device="cpu")
    print(f"load {time.perf_counter() - t:.2f} s; {describe()}")
    engine = LLMEngine(loaded, EngineConfig(kv_memory="256MiB", enable_prefix_caching=False))
    tok = loaded.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    answer = engine.generate([ids], SamplingParams(max_tokens=20, temperature=0))[0]
    print(repr(tok.decode(answer.token_ids)))
    prompt = tok.encode("A transformer keeps the keys and values of every token it has read. " * 20)[:128]

    def decode(n: int) -> float:
        engine.add_request(prompt, SamplingParams(max_tokens=n + 1, temperature=0, ignore_eos=True))
        engine.step()
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return (time.perf_counter() - t) / n

    decode(4)
    print(f"decode {statistics.median(decode(32) for _ in range(3)) * 1e3:.1f} ms/step")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
