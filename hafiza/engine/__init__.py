"""The serving engine: requests, scheduler (continuous batching), model runner, sampler."""

from hafiza.engine.engine import EngineConfig, LLMEngine, RequestOutput
from hafiza.engine.sampling import SamplingParams
from hafiza.engine.sequence import CachePin

__all__ = ["CachePin", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
