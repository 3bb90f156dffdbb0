"""hafiza's GGUF header reader gives the same metadata and tensor directory as gguf's GGUFReader."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFReader

from hafiza.errors import ModelLoadError
from hafiza.models.gguf_header import read_header
from hafiza.models.loader import default_model_path


def test_default_model_header_matches_gguf_reader() -> None:
    path = default_model_path()
    mine, theirs = read_header(path), GGUFReader(str(path), "r")
    expect = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert mine.fields == expect
    assert len(mine.tensors) == len(theirs.tensors)
    for a, b in zip(mine.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == \
            (b.name, b.tensor_type, int(b.n_elements), int(b.n_bytes), int(b.data_offset))
        assert a.shape == tuple(int(x) for x in reversed(b.shape.tolist()))


@pytest.mark.parametrize("cut", [3, 20, 1000, 3_000_000])
def test_truncated_header_is_one_load_error(tmp_path: Path, cut: int) -> None:
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(default_model_path().read_bytes()[:cut])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf"):
        read_header(bad)
