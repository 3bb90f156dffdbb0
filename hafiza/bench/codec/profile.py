"""Where the fast coder's decode time goes, per 256-token chunk of real bf16 KV: the whole decode through the
API, and each stage alone (the Huffman frame's zstd decompression, the compiled kernel, the CRC-32), timed over
every chunk in decode order. `python -m hafiza.bench.codec.profile [TEXT] [TOKENS]` (one thread)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from hafiza.codec import CodecContext, container, decode, encode
from hafiza.codec.checksum import crc32
from hafiza.codec.coders import CODER_IDS
from hafiza.codec.coders.fast import _HEAD, FastCoder, warm_up
from hafiza.codec.layout import chunks, view_shape

REPEATS = 7


def _cpu_s(run: Callable[[], object]) -> float:
    """Median CPU seconds of REPEATS runs."""
    times = []
    for _ in range(REPEATS):
        start = time.process_time()
        run()
        times.append(time.process_time() - start)
    return float(np.median(times))


def profile(x: torch.Tensor) -> dict[str, float]:
    """Microseconds per chunk of each stage for one bf16 tensor [layers, tokens, heads, dim]."""
    ctx = CodecContext(coder="fast")
    data = encode(x, ctx)
    header, model, payloads = container.read(data)
    vshape = view_shape(header.shape)
    bound = CODER_IDS[FastCoder.id]().bind(model, header.fmt, vshape, None)
    refs = chunks(header.shape, header.chunk_tokens)
    out = np.empty(vshape, np.uint16)
    slices = [out[r.group, r.start : r.stop] for r in refs]

    def frames() -> None:
        for r, p in zip(refs, payloads, strict=True):
            end = _HEAD.size + _HEAD.unpack_from(p, 0)[2]
            bound.dctx.decompress(p[_HEAD.size : end], max_output_size=(r.stop - r.start) * vshape[2])

    def decode_into() -> None:
        for r, p, dst in zip(refs, payloads, slices, strict=True):
            bound.decode_into(p, r, dst)

    def checksums() -> None:
        for dst in slices:
            crc32(dst)

    per = 1e6 / len(refs)
    whole, into, zstd_s, crc_s = (_cpu_s(f) for f in (lambda: decode(data, ctx), decode_into, frames, checksums))
    return {"chunks": len(refs), "bytes_per_chunk": x.numel() * 2 / len(refs), "decode_us": whole * per,
            "zstd_us": zstd_s * per, "kernel_and_python_us": (into - zstd_s) * per, "crc_us": crc_s * per,
            "container_and_loop_us": (whole - into - crc_s) * per, "decode_MBps": x.numel() * 2 / whole / 1e6}


def main() -> None:
    from hafiza.models import load_model
    from hafiza.models.capture import compute_kv

    text = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("bench/texts/de_grimm_maerchen.txt")
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    torch.set_num_threads(1)
    warm_up()
    lm = load_model(dtype="fp32", device="cpu", weights="fp32")
    ids = lm.tokenizer.encode(text.read_text(encoding="utf-8"))[:tokens]
    k, v = compute_kv(lm.model, ids, kv_dtype=torch.bfloat16)
    print(f"load average {os.getloadavg()[0]:.1f}; {text.name}, {len(ids)} tokens; us per chunk, median of {REPEATS}")
    for role, x in (("K", k), ("V", v)):
        r = profile(x)
        print(f"{role}: {r['chunks']} chunks of {r['bytes_per_chunk'] / 1e3:.0f} KB; decode {r['decode_us']:.1f} "
              f"({r['decode_MBps']:.0f} MB/s) = zstd {r['zstd_us']:.1f} + kernel and Python "
              f"{r['kernel_and_python_us']:.1f} + CRC {r['crc_us']:.1f} + container and loop "
              f"{r['container_and_loop_us']:.1f}")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
