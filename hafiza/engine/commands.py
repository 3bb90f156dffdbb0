"""What the async engine's callers send the engine thread: typed commands, taken between steps in order."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hafiza.engine.sampling import SamplingParams
from hafiza.engine.sequence import CachePin

if TYPE_CHECKING:
    from hafiza.engine.engine import LLMEngine


@dataclass(frozen=True)
class AddRequest:
    """Queue a request its caller has already checked (`LLMEngine.check_request`)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    pins: tuple[CachePin, ...]


@dataclass(frozen=True)
class AbortRequest:
    """Stop a request and free its blocks (its caller went away)."""

    request_id: str


@dataclass(frozen=True)
class EngineCall:
    """Run `fn(engine)` on the engine thread between steps; its result or exception goes to `future`."""

    fn: Callable[[LLMEngine], object]
    future: concurrent.futures.Future[object]


Command = AddRequest | AbortRequest | EngineCall
