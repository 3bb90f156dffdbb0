"""Quantised pools stored natively: a block's codes and scales through each tier codec and back bit for bit, at
their own width, and across two engines sharing one real redis-server."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hafiza.cache.formats.native import NativeBlocks, PartSpec
from hafiza.cache.hashing import chain_hashes
from hafiza.cache.layout import KVLayout
from hafiza.cache.pool import make_kv_pool
from hafiza.codec import container
from hafiza.codec.errors import CodecError
from hafiza.engine import LLMEngine
from hafiza.errors import ConfigError
from hafiza.models import LoadedModel
from hafiza.store.connector import StoreConnector
from hafiza.store.memory import MemoryStore
from hafiza.store.native import decode_native, encode_native, split_parts
from hafiza.store.redis_store import RedisStore
from hafiza.store.tiered import TieredStore
from tests.support.redis_server import RedisServer

from .conftest import unique_prefix
from .engine_support import cold, engine_with, prompt_ids, serve

LAYOUT = KVLayout(num_layers=3, num_blocks=4, block_size=16, num_kv_heads=2, head_dim=64, kv_dtype="fp32",
                  compute_dtype=torch.float32)
BS = 16
N = 72  # tokens: 4 full blocks can come from the store (the last token is always computed)


def _native_block(kind: str, seed: int = 0) -> tuple[NativeBlocks, PartSpec]:
    pool = make_kv_pool(replace(LAYOUT, kv_dtype=kind), "cpu", window_blocks=0)
    g = torch.Generator().manual_seed(seed)
    for layer in range(LAYOUT.num_layers):
        k, v = (torch.randn(48, 2, 64, generator=g) * (layer + 1) for _ in "kv")
        pool.write(layer, torch.arange(48), k, v)
    return pool.read_native([1]), pool.native_spec()


@pytest.mark.parametrize("codec", ["raw", "zstd", "fast"])
@pytest.mark.parametrize("kind", ["bf16", "fp8", "int8", "int4"])
def test_native_block_round_trips_through_each_codec(kind: str, codec: str) -> None:
    native, spec = _native_block(kind)
    blob = encode_native(native, codec)
    back = decode_native(blob, kind, LAYOUT.num_layers, spec)
    assert back.equal(native)
    if codec == "raw":  # payload plus scales, and the containers' headers
        assert native.nbytes <= len(blob) <= native.nbytes + 600


@pytest.mark.parametrize("kind", ["fp8", "int8", "int4"])
def test_damaged_or_foreign_native_block_is_refused(kind: str) -> None:
    native, spec = _native_block(kind)
    blob = bytearray(encode_native(native, "zstd"))
    flipped = bytes(blob[:-5]) + bytes([blob[-5] ^ 0x40]) + bytes(blob[-4:])
    with pytest.raises(CodecError):
        decode_native(flipped, kind, LAYOUT.num_layers, spec)
    with pytest.raises(CodecError):
        decode_native(bytes(blob[:-1]), kind, LAYOUT.num_layers, spec)
    other, _ = _native_block("fp8" if kind != "fp8" else "int8")
    with pytest.raises((CodecError, ValueError)):
        decode_native(encode_native(other, "zstd"), kind, LAYOUT.num_layers, spec)


def _redis_engine(model: LoadedModel, server: RedisServer, prefix: str, kind: str, codec: str
                  ) -> tuple[LLMEngine, StoreConnector]:
    engine, conn = engine_with(model, TieredStore([RedisStore(server.url, prefix=prefix, name="redis")]),
                               kv_dtype=kind, codec=codec)
    assert conn is not None
    return engine, conn


@pytest.mark.parametrize(("kind", "codec"), [("int8", "fast"), ("fp8", "fast"), ("fp8", "speculative"),
                                             ("int8", "speculative")])
def test_quantised_block_saved_by_one_engine_loads_bit_identically_in_another(
        tiny_llama: LoadedModel, own_redis: RedisServer, kind: str, codec: str) -> None:
    ids = prompt_ids(tiny_llama, N)
    prefix = unique_prefix()
    a_engine, a = _redis_engine(tiny_llama, own_redis, prefix, kind, codec)
    on_a = serve(a_engine, ids)
    assert a.flush() and a.stats.encoded_blocks >= 4 and a.stats.encode_errors == 0
    hashes = chain_hashes(ids, BS, (*a_engine.extra_keys, None))[:4]

    b_engine, b = _redis_engine(tiny_llama, own_redis, prefix, kind, codec)
    on_b = serve(b_engine, ids)
    assert on_b.external == 4 * BS and on_b.sources == {"redis": 4 * BS}
    assert b.stats.decode_fallbacks == 0
    if codec == "speculative":  # the codes' residuals against predicted codes, the scales beside them
        assert on_b.decision.startswith("load: predict+decode:") and b.stats.predictor_seconds > 0
        stored = a.store.tiers[0].get(a.key(hashes[2]))
        assert stored is not None
        header, _, _ = container.read(split_parts(memoryview(stored))["codes"])
        assert (header.coder_id, header.predictor_id) == (3, 2)
    assert on_b.tokens == on_a.tokens == cold(tiny_llama, ids, kv_dtype=kind)
    blocks = [[e.blocks.hash_to_block[h] for h in hashes] for e in (a_engine, b_engine)]
    assert b_engine.kv.read_native(blocks[1]).equal(a_engine.kv.read_native(blocks[0]))
    for layer in range(tiny_llama.model.config.num_layers):
        ga = a_engine.kv.gather(layer, torch.tensor([blocks[0]]))
        gb = b_engine.kv.gather(layer, torch.tensor([blocks[1]]))
        assert all(torch.equal(x, y) for x, y in zip(ga, gb, strict=True))
    a.close()
    b.close()


@pytest.mark.parametrize("kind", ["fp8", "int8", "int4"])
def test_stored_bytes_per_block_are_the_codes_plus_scales(tiny_llama: LoadedModel, kind: str) -> None:
    ids = prompt_ids(tiny_llama, N)
    engine, conn = engine_with(tiny_llama, TieredStore([MemoryStore(16 << 20)]), kv_dtype=kind, codec="raw")
    serve(engine, ids)
    assert conn is not None and conn.flush()
    h = chain_hashes(ids, BS, (*engine.extra_keys, None))[0]
    stored = conn.store.tiers[0].get(conn.key(h))
    assert stored is not None
    c = tiny_llama.model.config
    bf16_block = 2 * c.num_layers * BS * c.num_kv_heads * c.head_dim * 2  # what the dequantised form stored
    per_block = engine.kv.bytes_per_block
    assert per_block <= len(stored) <= per_block + 640  # one ~100-byte container header per part
    assert len(stored) <= bf16_block * {"fp8": 0.65, "int8": 0.7, "int4": 0.55}[kind]
    conn.close()


def test_speculative_codec_refuses_an_int4_pool(tiny_llama: LoadedModel) -> None:
    with pytest.raises(ConfigError, match="speculative store codec cannot code int4") as err:
        engine_with(tiny_llama, TieredStore([MemoryStore(16 << 20)]), kv_dtype="int4", codec="speculative")
    assert err.value.setting == "store_codec"
