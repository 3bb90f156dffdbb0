"""encode / decode: a tensor to a framed container and back, bit for bit, verifying everything on the way."""

from __future__ import annotations

import math

import numpy as np
import torch

from hafiza.codec import container
from hafiza.codec.checksum import crc32
from hafiza.codec.coders import CODER_IDS, resolve_coder
from hafiza.codec.context import CodecContext
from hafiza.codec.errors import (
    ChecksumError,
    CodecError,
    ContextError,
    FormatError,
    PredictionMismatchError,
)
from hafiza.codec.formats import format_of, tensor_bits
from hafiza.codec.layout import chunks, view_shape
from hafiza.codec.predictors import PREDICTOR_IDS, Predictor, resolve_predictor

MAX_ELEMENTS = 1 << 40
_SIGNED = {8: torch.uint8, 16: torch.int16, 32: torch.int32}


def encode(tensor: torch.Tensor, context: CodecContext | None = None) -> bytes:
    """Code `tensor` (bf16, fp16, fp32, fp8 e4m3 or int8) losslessly into a self-describing container."""
    ctx = context or CodecContext()
    if ctx.chunk_tokens < 1:
        raise CodecError("chunk_tokens must be at least 1")
    fmt = format_of(tensor.dtype)
    shape = tuple(int(d) for d in tensor.shape)
    vshape = view_shape(shape)
    bits = tensor_bits(tensor).reshape(vshape)
    coder = resolve_coder(ctx.coder)
    predictor, bound_pred = None, None
    if coder.needs_predictor:
        predictor = resolve_predictor(ctx.predictor)
        bound_pred = predictor.bind(fmt, shape, ctx)
    refs = chunks(shape, ctx.chunk_tokens)
    model = coder.fit(bits, fmt, bound_pred, refs)
    bound = coder.bind(model, fmt, vshape, bound_pred)
    records, payloads = [], []
    for ref in refs:
        chunk = np.ascontiguousarray(bits[ref.group, ref.start : ref.stop])
        pred_crc = bound_pred.digest(ref) if bound_pred is not None else 0
        records.append(container.ChunkRecord(0, crc32(chunk), pred_crc))
        payloads.append(bound.encode(chunk, ref))
    header = container.Header(fmt, shape, coder.id, predictor.id if predictor else 0, ctx.chunk_tokens,
                              chunks=records)
    if predictor is not None:
        header.predictor_fingerprint = predictor.fingerprint()
        header.input_digest = predictor.input_digest(ctx)
    return container.write(header, model, payloads)


def decode(data: bytes | bytearray | memoryview, context: CodecContext | None = None) -> torch.Tensor:
    """The exact tensor `encode` was given.

    Raises FormatError / VersionError for foreign, truncated or damaged framing, ChecksumError for corrupt
    chunk data, ContextError when the context cannot supply the container's predictor, and
    PredictionMismatchError when the prediction cannot be reproduced here (recompute from tokens).
    """
    ctx = context or CodecContext()
    header, model, payloads = container.read(data)
    fmt, shape = header.fmt, header.shape
    if header.coder_id not in CODER_IDS:
        raise FormatError(f"hafiza KV container names unknown coder id {header.coder_id}")
    vshape = view_shape(shape)
    if math.prod(shape) > MAX_ELEMENTS or header.chunk_tokens < 1:
        raise FormatError("hafiza KV container header claims an impossible shape or chunk size")
    expected = vshape[0] * -(-vshape[1] // header.chunk_tokens) if math.prod(vshape) else 0
    if expected != len(header.chunks):
        raise FormatError("hafiza KV container chunk table does not match its shape")
    coder = CODER_IDS[header.coder_id]()
    predictor = _decode_predictor(header, ctx) if coder.needs_predictor else None
    bound_pred = predictor.bind(fmt, shape, ctx) if predictor is not None else None
    try:
        bound = coder.bind(model, fmt, vshape, bound_pred)
    except (ValueError, IndexError) as exc:
        raise FormatError(f"hafiza KV container model block is inconsistent ({exc})") from exc
    result = torch.empty(vshape, dtype=_SIGNED[fmt.width])  # decoded in place: no copy on the way out
    out = result.numpy().view(fmt.uint)
    for ref, rec, payload in zip(chunks(shape, header.chunk_tokens), header.chunks, payloads, strict=True):
        if bound_pred is not None and bound_pred.digest(ref) != rec.prediction_crc:
            raise PredictionMismatchError(
                f"chunk {ref.index}: the {predictor.name} prediction differs from the encoder's; "
                "recompute this KV from its tokens")
        dst = out[ref.group, ref.start : ref.stop]
        try:
            bound.decode_into(payload, ref, dst)
        except Exception as exc:
            raise ChecksumError(f"chunk {ref.index} is corrupt: it cannot be decoded ({exc})") from exc
        if crc32(dst) != rec.raw_crc:
            raise ChecksumError(f"chunk {ref.index} is corrupt: its checksum does not match")
    return result.view(fmt.torch_dtype).reshape(shape)


def _decode_predictor(header: container.Header, ctx: CodecContext) -> Predictor:
    if header.predictor_id not in PREDICTOR_IDS:
        raise FormatError(f"hafiza KV container names unknown predictor id {header.predictor_id}")
    cls = PREDICTOR_IDS[header.predictor_id]
    given = ctx.predictor if isinstance(ctx.predictor, Predictor) else None
    if given is None and isinstance(ctx.predictor, str) and ctx.predictor != cls.name:
        raise ContextError(f"the container was coded with predictor {cls.name!r}, not {ctx.predictor!r}")
    if given is not None and not isinstance(given, cls):
        raise ContextError(f"the container was coded with predictor {cls.name!r}, not {given.name!r}")
    predictor = given or cls()
    if predictor.fingerprint() != header.predictor_fingerprint:
        raise ContextError(f"the {cls.name} predictor given has other parameters than the encoder's")
    if predictor.input_digest(ctx) != header.input_digest:
        raise ContextError(f"the {cls.name} predictor's input (token ids) differs from the encoder's")
    return predictor
