"""The serving engine: requests, scheduler (continuous batching), model runner, sampler."""

from hafiza.engine.engine import EngineConfig, LLMEngine
from hafiza.engine.results import FinishReason, GenerationResult, RequestOutput
from hafiza.engine.sampling import SamplingParams
from hafiza.engine.sequence import CachePin

__all__ = ["CachePin", "EngineConfig", "FinishReason", "GenerationResult", "LLMEngine", "RequestOutput",
           "SamplingParams"]
