"""A GGUF header reader: metadata and tensor directory in one pass over a memory map, without touching tensor data.

gguf's GGUFReader builds a numpy view per metadata item and takes 5-16 s on a 49k-token vocabulary here; this
reads the same values (tests/models/test_gguf_header.py compares both) in well under a second.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

from hafiza.errors import ModelLoadError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclass
class TensorInfo:
    """One tensor of the directory: `shape` in Hugging Face order ([out, in]), bytes at `data_offset`."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int


@dataclass
class GGUFHeader:
    """Metadata key/values as plain Python values, and the tensor directory."""

    fields: dict[str, Any]
    tensors: list[TensorInfo]


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"string of {n} bytes runs past the end of the file")
        s = self.buf[self.pos : self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return s

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row: the loop of `string` with its lookups hoisted (a 151k-token vocabulary and
        its merges are 300k strings)."""
        buf, pos, size, length = self.buf, self.pos, len(self.buf), _U64.unpack_from
        out = []
        append = out.append
        for _ in range(count):
            (n,) = length(buf, pos)
            pos += 8
            if pos + n > size:
                raise ValueError(f"string of {n} bytes runs past the end of the file")
            append(buf[pos : pos + n].decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item == STRING:
                return self.strings(count)
            if item in _NP:
                dt = np.dtype(_NP[item])
                if self.pos + count * dt.itemsize > len(self.buf):
                    raise ValueError(f"array of {count} items runs past the end of the file")
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos += count * dt.itemsize
                return arr.astype(bool).tolist() if item == 7 else arr.tolist()
            return [self.value(item) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"unknown metadata value type {vtype}")
        return self.scalar(_SCALARS[vtype])


def read_header(path: Path) -> GGUFHeader:
    """Parse magic, metadata and tensor directory; any malformed or truncated header is one ModelLoadError."""
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            c = _Cursor(buf)
            if buf[:4] != b"GGUF":
                raise ValueError("bad magic")
            c.pos = 4
            version = c.scalar("<I")
            if version < 2:
                raise ValueError(f"GGUF version {version} is not supported (2 and later are)")
            n_tensors, n_kv = c.scalar("<Q"), c.scalar("<Q")
            if n_tensors > 1 << 20 or n_kv > 1 << 20:
                raise ValueError(f"implausible counts: {n_tensors} tensors, {n_kv} metadata keys")
            fields: dict[str, Any] = {}
            for _ in range(n_kv):
                key = c.string()
                fields[key] = c.value(c.scalar("<I"))
            infos = []
            for _ in range(n_tensors):
                name = c.string()
                dims = [c.scalar("<Q") for _ in range(c.scalar("<I"))]
                qtype = GGMLQuantizationType(c.scalar("<I"))
                infos.append((name, qtype, dims, c.scalar("<Q")))
            align = int(fields.get("general.alignment", 32))
            start = c.pos + (-c.pos) % align
            size = len(buf)
    except ModelLoadError:
        raise
    except Exception as exc:  # struct.error, ValueError (bad enum, bad magic), UnicodeError, OSError ...
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    tensors = []
    for name, qtype, dims, offset in infos:
        n = int(np.prod(dims)) if dims else 1
        block, type_size = GGML_QUANT_SIZES[qtype]
        if n % block:
            raise ModelLoadError(f"{path}: tensor {name} has {n} values, not a multiple of its {block}-value blocks")
        t = TensorInfo(name, qtype, tuple(int(d) for d in reversed(dims)), n, n // block * type_size, start + offset)
        if t.data_offset + t.n_bytes > size:
            raise ModelLoadError(f"{path}: tensor {name} is truncated ({t.n_bytes} bytes at {t.data_offset} of a "
                                 f"{size}-byte file)")
        tensors.append(t)
    return GGUFHeader(fields, tensors)
