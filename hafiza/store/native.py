"""A pool block in its native form (codes plus scales, `NativeBlocks`) to stored bytes and back, with the tier's
lossless codec on top. A quantised block travels as its own bytes: 1 byte a value for fp8 and int8, half a
byte for int4, plus scales; never dequantised, so a loader stores exactly what the saver held.

Stored value:
- full precision (no scales): the codec's container of the codes, the same bytes `encode_block` writes;
- quantised: b"HKVN" | version u8 | part count u8 | per part: name length u8, name, container length u32,
  container. Part "codes" [block_size, layers·2·heads·c] (token rows, as `encode_block` lays out a block) is
  coded with the tier's codec; each scale part [layers, rest] with the same codec, or `fast` when the tier's
  codec reruns a predictor (scales are a few percent of a block and have nothing to predict from).

`speculative` on fp8 or int8: the predictor's K/V are quantised with the block's own stored scales into
predicted codes, and the coder codes the codes' residuals against them (`CodePredictor`): scales are decoded
first, then the codes. int4's packed nibbles have no such prediction: speculative refuses int4 pools.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import torch

from hafiza.cache.codes import INT8_MAX, fp8_encode
from hafiza.cache.formats.native import NativeBlocks, PartSpec
from hafiza.codec import CodecContext, decode, encode
from hafiza.codec.errors import ContextError, FormatError
from hafiza.codec.formats import BitFormat, tensor_bits
from hafiza.codec.layout import view_shape
from hafiza.codec.predictors.base import BoundPredictor
from hafiza.codec.predictors.speculative import PrecomputedPrediction
from hafiza.errors import ConfigError
from hafiza.store.codecs import TOKEN_CODECS
from hafiza.store.speculative import BlockPredictor

MAGIC = b"HKVN"
VERSION = 1
SCALE_CODEC_FOR_TOKEN_CODECS = "fast"
PREDICTED_KV_DTYPES = frozenset({"bf16", "fp16", "fp32", "fp8", "int8"})
_HEAD = struct.Struct("<4sBB")
_LEN = struct.Struct("<I")
_CODEC_VIEW = {torch.uint8: torch.int8}  # int4's packed bytes: coded as int8 bit patterns (the codec has no uint8)


def check_predictable(kv_dtype: str, codecs: Sequence[str]) -> None:
    """Refuse a predictor-rerunning codec on a pool whose codes it cannot predict (int4's packed nibbles)."""
    token = sorted(set(codecs) & TOKEN_CODECS)
    if token and kv_dtype not in PREDICTED_KV_DTYPES:
        raise ConfigError(f"the {token[0]} store codec cannot code {kv_dtype} KV blocks (packed 4-bit codes have no "
                          f"predicted codes); use {', '.join(sorted(PREDICTED_KV_DTYPES))} KV or another codec",
                          setting="store_codec")


class CodePredictor(BlockPredictor):
    """The block predictor's K/V quantised with a block's stored scales: predicted fp8 or int8 codes."""

    def __init__(self, base: BlockPredictor, native: NativeBlocks) -> None:
        super().__init__(base.kv, "")
        self._fingerprint = base.fingerprint()
        self.native = native

    def bind(self, fmt: BitFormat, shape: tuple[int, ...], context: CodecContext) -> BoundPredictor:
        codes = predicted_codes(self.predicted_block(context), self.native)
        pred = codes.permute(2, 0, 1, 3, 4).reshape(self.kv.block_size, -1)
        if tuple(pred.shape) != tuple(shape) or pred.dtype != fmt.torch_dtype:
            raise ContextError(f"predicted codes {tuple(pred.shape)} {pred.dtype}, block codes {tuple(shape)} "
                               f"{fmt.torch_dtype}")
        ordered = fmt.to_ordered(tensor_bits(pred.contiguous()))
        return PrecomputedPrediction(fmt, ordered.astype(fmt.uint).reshape(view_shape(tuple(shape))))


def predicted_codes(block: torch.Tensor, native: NativeBlocks) -> torch.Tensor:
    """K/V [layers, 2, bs, heads, dim] as the codes the pool would store under `native`'s (one block's) scales."""
    s = native.scales
    if native.kv_dtype == "fp8":
        scale = torch.stack([s["k_scale"][:, 0], s["v_scale"][:, 0]], dim=1)  # [layers, 2, heads]
        return fp8_encode(block, scale[:, :, None, :, None])
    if native.kv_dtype == "int8":
        scale = torch.stack([s["k_scale"][:, 0], s["v_scale"][:, 0]], dim=1).float()  # [layers, 2, bs, heads]
        return torch.round(block.float() / scale[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    if native.kv_dtype in ("bf16", "fp16", "fp32"):
        return block.to(native.codes.dtype)
    raise ContextError(f"no predicted codes for {native.kv_dtype} KV blocks")


def _codes_2d(codes: torch.Tensor) -> torch.Tensor:
    """One block's codes [layers, 2, 1, bs, heads, c] as the codec's [bs, layers·2·heads·c]."""
    c = codes[:, :, 0]
    flat = c.permute(2, 0, 1, 3, 4).reshape(c.shape[2], -1).contiguous()
    return flat.view(_CODEC_VIEW[flat.dtype]) if flat.dtype in _CODEC_VIEW else flat


def encode_native(native: NativeBlocks, codec: str, token_ids: Sequence[int] | None = None,
                  predictor: BlockPredictor | None = None) -> bytes:
    """One block (n = 1) to stored bytes; `token_ids` and `predictor` for a predictor-rerunning codec only."""
    if native.num_blocks != 1:
        raise ValueError(f"encode_native codes one block, got {native.num_blocks}")
    codes = encode(_codes_2d(native.codes), _context(codec, token_ids, predictor, native))
    if not native.scales:
        return codes
    scale_codec = SCALE_CODEC_FOR_TOKEN_CODECS if codec in TOKEN_CODECS else codec
    ctx = CodecContext(coder=scale_codec)
    parts = [("codes", codes)] + [(name, encode(t.reshape(t.shape[0], -1).contiguous(), ctx))
                                  for name, t in sorted(native.scales.items())]
    out = [_HEAD.pack(MAGIC, VERSION, len(parts))]
    for name, blob in parts:
        nb = name.encode()
        out += [bytes([len(nb)]), nb, _LEN.pack(len(blob)), blob]
    return b"".join(out)


def decode_native(data: bytes | memoryview, kv_dtype: str, num_layers: int, spec: PartSpec,
                  token_ids: Sequence[int] | None = None, predictor: BlockPredictor | None = None) -> NativeBlocks:
    """The one block `encode_native` was given, checked against the pool's `spec`; raises CodecError (damaged
    container, PredictionMismatchError) or FormatError / ValueError (foreign framing, another shape or dtype)."""
    code_shape, code_dtype = spec["codes"]
    view = memoryview(data).cast("B")
    if len(spec) == 1:
        codes = _decode_codes(view, code_shape, code_dtype, num_layers, token_ids, predictor, None)
        return NativeBlocks(kv_dtype, codes)
    blobs = split_parts(view)
    if set(blobs) != set(spec):
        raise FormatError(f"stored {kv_dtype} block has parts {sorted(blobs)}, expected {sorted(spec)}")
    scales = {}
    for name, (shape, dtype) in spec.items():
        if name == "codes":
            continue
        t = decode(blobs[name])
        want = (num_layers, 1, *shape)
        if t.dtype != dtype or t.numel() != int(np.prod(want)):
            raise ValueError(f"stored scale {name!r} is {tuple(t.shape)} {t.dtype}, expected {want} {dtype}")
        scales[name] = t.reshape(want)
    header = NativeBlocks(kv_dtype, torch.empty(0), scales)
    codes = _decode_codes(blobs["codes"], code_shape, code_dtype, num_layers, token_ids, predictor, header)
    return NativeBlocks(kv_dtype, codes, scales)


def _decode_codes(data: memoryview, shape: tuple[int, ...], dtype: torch.dtype, num_layers: int,
                  token_ids: Sequence[int] | None, predictor: BlockPredictor | None,
                  scales: NativeBlocks | None) -> torch.Tensor:
    bs, heads, c = shape
    ctx = CodecContext()
    if predictor is not None and token_ids:
        p = CodePredictor(predictor, scales) if scales is not None else predictor
        ctx = CodecContext(predictor=p, token_ids=list(token_ids))
    t = decode(data, ctx)
    coded = _CODEC_VIEW.get(dtype, dtype)
    expected = (bs, num_layers * 2 * heads * c)
    if tuple(t.shape) != expected or t.dtype != coded:
        raise ValueError(f"stored block is {tuple(t.shape)} {t.dtype}, expected {expected} {coded}")
    t = t.view(dtype) if coded != dtype else t
    return t.view(bs, num_layers, 2, heads, c).permute(1, 2, 0, 3, 4).unsqueeze(2).contiguous()


def split_parts(view: memoryview) -> dict[str, memoryview]:
    """A quantised block's stored bytes as its named containers; FormatError for foreign or cut framing."""
    if len(view) < _HEAD.size:
        raise FormatError("not a native KV block: too short for its header")
    magic, version, count = _HEAD.unpack_from(view, 0)
    if magic != MAGIC or version != VERSION:
        raise FormatError(f"not a native KV block (magic {bytes(magic)!r}, version {version})")
    pos, parts = _HEAD.size, {}
    for _ in range(count):
        if pos + 1 > len(view):
            raise FormatError("native KV block truncated in its part table")
        n = view[pos]
        name = bytes(view[pos + 1 : pos + 1 + n]).decode("ascii", "replace")
        pos += 1 + n
        if pos + _LEN.size > len(view):
            raise FormatError("native KV block truncated in its part table")
        (length,) = _LEN.unpack_from(view, pos)
        pos += _LEN.size
        if pos + length > len(view):
            raise FormatError(f"native KV block part {name!r} truncated")
        parts[name] = view[pos : pos + length]
        pos += length
    if pos != len(view):
        raise FormatError(f"native KV block followed by {len(view) - pos} trailing bytes")
    return parts


def _context(codec: str, token_ids: Sequence[int] | None, predictor: BlockPredictor | None,
             native: NativeBlocks) -> CodecContext:
    if codec not in TOKEN_CODECS:
        return CodecContext(coder=codec)
    if predictor is None or not token_ids:
        raise ContextError(f"the {codec} store codec needs the block's prefix tokens and the model's predictor")
    p = CodePredictor(predictor, native) if native.scales else predictor
    return CodecContext(coder="predictive", predictor=p, token_ids=list(token_ids))
