"""The start-up line reports the pool the engine really allocated."""

from __future__ import annotations

from hafiza.engine import EngineConfig, LLMEngine
from hafiza.engine.async_engine import AsyncEngine
from hafiza.models import LoadedModel
from hafiza.server.launch import describe


def test_startup_line_prints_the_pools_real_block_bytes(default_model: LoadedModel) -> None:
    """The default kv_dtype stores bf16 under fp32 compute: a block is half the fp32 figure."""
    engine = LLMEngine(default_model, EngineConfig(kv_memory="4MiB"))
    pool = engine.kv
    stored = sum(t[0].nbytes for t in pool.k + pool.v)  # block 0 of every layer's K and V tensors
    assert stored == pool.bytes_per_block == 2 * 30 * 3 * 64 * 2 * 16 == 368_640  # SmolLM2-135M, 16-token blocks
    line = describe(AsyncEngine(engine))
    assert f"({stored} B per block, bf16)" in line
    assert f"{engine.layout.num_blocks} blocks x 16 tokens" in line
