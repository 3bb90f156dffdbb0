"""Bit formats: each dtype as unsigned integers, its mantissa width and an order-preserving map."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hafiza.codec.errors import UnsupportedDtypeError


@dataclass(frozen=True)
class BitFormat:
    """One dtype's values as `width`-bit unsigned words; the low `mantissa` bits are noise-like.

    `ordered` maps bit patterns to integers that sort like the values (sign-magnitude floats flipped, two's
    complement ints offset), so a difference of ordered integers counts representable steps between values.
    """

    name: str
    code: int
    torch_dtype: torch.dtype
    width: int
    mantissa: int
    exponent: int
    signed_magnitude: bool

    @property
    def uint(self) -> np.dtype:
        return np.dtype({8: np.uint8, 16: np.uint16, 32: np.uint32}[self.width])

    @property
    def nbytes(self) -> int:
        return self.width // 8

    @property
    def mask(self) -> int:
        return (1 << self.width) - 1

    def to_ordered(self, bits: np.ndarray) -> np.ndarray:
        """Bit patterns (uint) -> order-preserving unsigned integers of the same width (pure integer ops)."""
        top = self.uint.type(1 << (self.width - 1))
        if not self.signed_magnitude:
            return bits ^ top
        negative = (bits & top) != 0
        return np.where(negative, ~bits, bits | top).astype(self.uint, copy=False)

    def from_ordered(self, ordered: np.ndarray) -> np.ndarray:
        """Inverse of to_ordered."""
        top = self.uint.type(1 << (self.width - 1))
        if not self.signed_magnitude:
            return ordered ^ top
        positive = (ordered & top) != 0
        return np.where(positive, ordered & ~top, ~ordered).astype(self.uint, copy=False)

    @property
    def max_magnitude(self) -> int:
        """Largest value of split()'s magnitude: the exponent field, or |v| for ints."""
        return (1 << self.exponent) - 1 if self.exponent else 1 << (self.width - 1)

    def split(self, bits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Bits -> (sign 0/1, magnitude class, low bits) as int64, int64, uint32; floats: exponent field and
        mantissa; ints: |v| and no low bits."""
        b = bits.astype(np.int64)
        sign = b >> (self.width - 1)
        if self.exponent:
            mag = (b >> self.mantissa) & ((1 << self.exponent) - 1)
            low = (b & ((1 << self.mantissa) - 1)).astype(np.uint32)
            return sign, mag, low
        value = b - (sign << self.width)
        return sign, np.abs(value), np.zeros(b.shape, np.uint32)

    def join(self, sign: np.ndarray, mag: np.ndarray, low: np.ndarray) -> np.ndarray:
        """Inverse of split (inputs outside the format's ranges are masked, never trusted)."""
        if self.exponent:
            b = (sign << (self.width - 1)) | ((mag & ((1 << self.exponent) - 1)) << self.mantissa)
            b = b | (low.astype(np.int64) & ((1 << self.mantissa) - 1))
        else:
            b = np.where(sign != 0, -mag, mag)
        return (b & self.mask).astype(self.uint)

    def exponent_field(self, bits: np.ndarray) -> np.ndarray:
        """Biased exponent of each pattern as int32 (0 for ints, where magnitude has no exponent)."""
        if self.exponent == 0:
            return np.zeros(bits.shape, np.int32)
        return ((bits.astype(np.int64) >> self.mantissa) & ((1 << self.exponent) - 1)).astype(np.int32)


FORMATS: dict[str, BitFormat] = {
    f.name: f
    for f in (
        BitFormat("bf16", 1, torch.bfloat16, 16, 7, 8, True),
        BitFormat("fp16", 2, torch.float16, 16, 10, 5, True),
        BitFormat("fp32", 3, torch.float32, 32, 23, 8, True),
        BitFormat("fp8_e4m3", 4, torch.float8_e4m3fn, 8, 3, 4, True),
        BitFormat("int8", 5, torch.int8, 8, 0, 0, False),
    )
}
BY_CODE = {f.code: f for f in FORMATS.values()}
BY_TORCH = {f.torch_dtype: f for f in FORMATS.values()}
_VIEW = {8: torch.uint8, 16: torch.int16, 32: torch.int32}


def format_of(dtype: torch.dtype) -> BitFormat:
    """The bit format of a torch dtype, or UnsupportedDtypeError naming the ones that exist."""
    if dtype not in BY_TORCH:
        names = ", ".join(FORMATS)
        raise UnsupportedDtypeError(f"the KV codec does not code {dtype}; it codes {names}")
    return BY_TORCH[dtype]


def tensor_bits(tensor: torch.Tensor) -> np.ndarray:
    """The raw bit patterns of a CPU copy of `tensor` as an unsigned numpy array of the same shape."""
    fmt = format_of(tensor.dtype)
    t = tensor.detach().to("cpu").contiguous()
    return t.view(_VIEW[fmt.width]).numpy().view(fmt.uint)


def bits_tensor(bits: np.ndarray, fmt: BitFormat) -> torch.Tensor:
    """A torch tensor of `fmt`'s dtype whose bit patterns are `bits` (no float arithmetic involved)."""
    arr = np.ascontiguousarray(bits.astype(fmt.uint, copy=False))
    signed = {8: np.uint8, 16: np.int16, 32: np.int32}[fmt.width]
    return torch.from_numpy(arr.view(signed).copy()).view(fmt.torch_dtype).reshape(bits.shape)
