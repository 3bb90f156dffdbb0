"""describe(): what a container holds, read from its verified header without decoding any chunk."""

from __future__ import annotations

import math
from typing import Any

from hafiza.codec import container
from hafiza.codec.coders import CODER_IDS
from hafiza.codec.predictors import PREDICTOR_IDS


def describe(data: bytes | memoryview) -> dict[str, Any]:
    """Header facts and sizes of a container (framing is verified; chunk contents are not decoded)."""
    header, model, payloads = container.read(data)
    n = math.prod(header.shape)
    lengths = sorted(len(p) for p in payloads)
    coder = CODER_IDS.get(header.coder_id)
    predictor = PREDICTOR_IDS.get(header.predictor_id)
    return {
        "format_version": container.VERSION,
        "dtype": header.fmt.name,
        "shape": list(header.shape),
        "coder": coder.name if coder else f"unknown ({header.coder_id})",
        "predictor": predictor.name if predictor else "none",
        "predictor_fingerprint": header.predictor_fingerprint.hex() if predictor else None,
        "input_digest": header.input_digest.hex() if predictor else None,
        "chunk_tokens": header.chunk_tokens,
        "chunks": len(payloads),
        "chunk_bytes_min_median_max": [lengths[0], lengths[len(lengths) // 2], lengths[-1]] if lengths else [],
        "model_block_bytes": len(model),
        "total_bytes": len(data),
        "raw_bytes": n * header.fmt.nbytes,
        "bits_per_value": 8 * len(data) / n if n else 0.0,
    }
