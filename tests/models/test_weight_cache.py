"""The weight cache gives back exactly the repacked arrays it was given, never a stale or partial entry, and
a model loaded from it computes the same outputs as one repacked from the file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from hafiza.models import load_model
from hafiza.models.gguf_file import config_from_gguf, gguf_fields, gguf_sources, open_gguf
from hafiza.models.linear import ConcatLinear, Int4Linear, Int8Linear, Linear
from hafiza.models.loader import default_model_path
from hafiza.models.weight_cache import KEEP, WeightCache, model_key, open_cache
from hafiza.models.weights import ModelWeights, build_model_weights
from tests.support.gguf_models import Shape, write_model

CPU = torch.device("cpu")
SHAPE = Shape(hidden=256, inter=512, layers=2, heads=4, kv_heads=2)
MIXED = {"embed": T.Q8_0, "attn_q": T.Q4_0, "attn_k": T.Q4_1, "attn_v": T.Q6_K, "attn_output": T.Q4_K,
         "ffn_gate": T.Q5_0, "ffn_up": T.Q5_K, "ffn_down": T.Q8_0, "output": T.Q6_K}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("wc") / "mixed.gguf", default_model_path(), MIXED, SHAPE, tied=False)


def build(path: Path, cache: WeightCache | None) -> ModelWeights:
    header = open_gguf(path)
    config = config_from_gguf(gguf_fields(header), path)
    with path.open("rb") as f:
        sources = gguf_sources(header, f, config, path)
        return build_model_weights(sources, config.num_layers, False, "auto", torch.float32, CPU, cache)


def arrays(lin: Linear) -> list[torch.Tensor]:
    if isinstance(lin, ConcatLinear):
        return [t for p in lin.parts for t in arrays(p)]
    if isinstance(lin, Int4Linear):
        return [lin.packed, lin.scale_zero.view(torch.int16)]
    if isinstance(lin, Int8Linear):
        return [lin.q, lin.scale.view(torch.int16)]
    return []


def test_second_build_maps_the_same_arrays(model: Path, tmp_path: Path) -> None:
    first = WeightCache(tmp_path, model_key(model, "auto", CPU))
    built = build(model, first)
    first.flush()
    assert first.hits == 0 and first.misses > 0
    again = WeightCache(tmp_path, model_key(model, "auto", CPU))
    cached = build(model, again)
    assert again.misses == 0 and again.hits == first.misses
    for a, b in zip(built.linears(), cached.linears(), strict=True):
        assert a.kind == b.kind
        got, want = arrays(b), arrays(a)
        assert got and len(got) == len(want)
        assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))


def test_wrong_sized_entry_is_rebuilt(model: Path, tmp_path: Path) -> None:
    cache = WeightCache(tmp_path, model_key(model, "auto", CPU))
    reference = build(model, cache)
    cache.flush()
    victim = max(cache.dir.iterdir(), key=lambda f: f.stat().st_size)
    victim.write_bytes(victim.read_bytes()[:-7])  # a truncated entry
    again = WeightCache(tmp_path, model_key(model, "auto", CPU))
    rebuilt = build(model, again)
    assert again.misses == 1
    for a, b in zip(reference.linears(), rebuilt.linears(), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(arrays(a), arrays(b), strict=True))


def test_key_follows_file_mode_and_device(model: Path, tmp_path: Path) -> None:
    key = model_key(model, "auto", CPU)
    assert key != model_key(model, "q8", CPU)
    assert key != model_key(model, "auto", torch.device("cuda"))
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(model.read_bytes())
    st = model.stat()
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert model_key(copy, "auto", CPU) == key  # same bytes, size and mtime: the same weights
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert model_key(copy, "auto", CPU) != key  # a rewritten file is never served stale arrays


def test_off_and_eviction(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HAFIZA_WEIGHTS_CACHE", "off")
    assert open_cache(model, "auto", CPU) is None
    cache = tmp_path / "cache"
    monkeypatch.setenv("HAFIZA_WEIGHTS_CACHE", str(cache))
    files = []
    for i in range(KEEP // 5 + 1):  # five modes a file, distinct files by mtime: more models than KEEP
        files.append(tmp_path / f"m{i}.gguf")
        files[-1].write_bytes(model.read_bytes())
        os.utime(files[-1], ns=(0, 10**9 * (i + 1)))
    used = [(f, mode) for f in files for mode in ("auto", "q4", "q8", "bf16", "fp32")][: KEEP + 2]
    for f, mode in [*used, used[0]]:
        assert open_cache(f, mode, CPU) is not None
    kept = {d.name for d in cache.iterdir()}
    assert len(kept) == KEEP and model_key(*used[0], CPU) in kept  # the first, used again last, stays
    assert model_key(*used[1], CPU) not in kept and model_key(*used[2], CPU) not in kept


def test_loaded_from_cache_computes_the_same(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HAFIZA_WEIGHTS_CACHE", str(tmp_path))
    fresh = load_model(model, device="cpu")
    entry_dir = tmp_path / model_key(model, "auto", CPU)
    cache = WeightCache(tmp_path, model_key(model, "auto", CPU))
    build(model, cache)  # the same entries, flushed here: every entry exists (entries are whole or absent)
    cache.flush()
    cached = load_model(model, device="cpu")
    ids = torch.tensor([1, 2, 3, 4, 5])
    a = fresh.model.embed(ids)
    b = cached.model.embed(ids)
    assert torch.equal(a, b)
    gen = torch.Generator().manual_seed(0)
    for x, y in zip(fresh.model.weights.linears(), cached.model.weights.linears(), strict=True):
        h = torch.randn(3, x.in_features, generator=gen)
        assert torch.equal(x(h), y(h))
    assert any(entry_dir.iterdir())
