"""One generation seen from the HTTP side: start it, read its outputs, time it, explain its cache use."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from fastapi import Request

from hafiza.engine.async_engine import EngineDeadError, EngineOverloadedError
from hafiza.engine.engine import RequestOutput
from hafiza.engine.sampling import SamplingParams
from hafiza.engine.sequence import CachePin
from hafiza.errors import RequestError
from hafiza.server.errors import ApiError, OverloadedError
from hafiza.server.explain import Explanation
from hafiza.server.prompt import Prompt
from hafiza.server.state import ServerState
from hafiza.server.streaming import ClientGone, DisconnectWatch, OutputStream


class Generation:
    """Runs `prompt` on the engine for one HTTP request. Always `close()` it (it aborts an unfinished request).
    `cache_salt` is the request's cache partition (see `request_partition`): it keys its blocks in the pool and
    every tier, and the explainer compares it only with prompts of the same partition."""

    def __init__(self, state: ServerState, api: str, request: Request, prompt: Prompt, params: SamplingParams,
                 request_id: str, pins: Sequence[CachePin] = (), ignored_breakpoints: int = 0,
                 cache_salt: str | None = None) -> None:
        self.state, self.api, self.request, self.prompt, self.params = state, api, request, prompt, params
        self.request_id, self.pins, self.ignored_breakpoints = request_id, list(pins), ignored_breakpoints
        self.cache_salt = cache_salt
        self.stream: OutputStream | None = None
        self.explanation: Explanation | None = None
        self.last: RequestOutput | None = None
        self.text: list[str] = []
        self._last_output_at: float | None = None

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished

    @property
    def output_tokens(self) -> int:
        return self.last.num_output_tokens if self.last else 0

    async def start(self) -> RequestOutput:
        """Queue the request and wait for its first output (the prompt is then fully computed)."""
        self.stream = OutputStream(self.state.aengine, self.prompt.ids, self.params, self.request_id, self.pins,
                                   DisconnectWatch(self.request), self.cache_salt)
        first = await self.next()
        assert first is not None
        computed_at = first.first_token_time or time.monotonic()
        self.explanation = self.state.explainer.explain(
            self.request_id, self.prompt, first.num_cached_tokens, first.arrival_time, computed_at,
            self.ignored_breakpoints, self.state.settings.min_cache_tokens, self.cache_salt)
        if first.first_token_time is not None:
            self.state.metrics.ttft.labels(self.api).observe(first.first_token_time - first.arrival_time)
        return first

    async def next(self, timeout: float | None = None) -> RequestOutput | None:
        """The next output (None after `timeout` seconds without one). Engine failures become ApiErrors."""
        assert self.stream is not None
        try:
            out = await self.stream.next(timeout)
        except ClientGone:
            self.state.metrics.disconnects.labels(self.api).inc()
            raise
        except RequestError as exc:
            raise ApiError(400, str(exc)) from exc
        except EngineDeadError as exc:
            raise ApiError(500, str(exc)) from exc
        except EngineOverloadedError as exc:
            raise OverloadedError(str(exc), exc.retry_after_s) from exc
        if out is not None:
            self._observe(out)
        return out

    async def rest(self) -> None:
        """Read every remaining output (the non-streaming case)."""
        while not self.finished:
            await self.next()

    async def close(self) -> None:
        if self.stream is not None:
            await self.stream.close()

    def _observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        m = self.state.metrics
        if out.new_token_ids:
            if self._last_output_at is not None:
                m.itl.labels(self.api).observe(now - self._last_output_at)
            self._last_output_at = now
        self.text.append(out.text)
        self.last = out
        if out.finished:
            m.requests.labels(self.api, out.finish_reason or "unknown").inc()
            m.request_prompt_tokens.labels(self.api).inc(out.num_prompt_tokens)
            m.request_generation_tokens.labels(self.api).inc(out.num_output_tokens)
            m.e2e.labels(self.api).observe(now - out.arrival_time)


async def run_to_end(gen: Generation) -> None:
    """Start and finish a generation, closing it whatever happens (client gone, engine error, cancellation)."""
    try:
        await gen.start()
        await gen.rest()
    finally:
        await asyncio.shield(gen.close())


async def start_stream(gen: Generation) -> RequestOutput:
    """Start a generation whose outputs will be streamed; close it if it fails before the stream begins."""
    try:
        return await gen.start()
    except BaseException:
        await asyncio.shield(gen.close())
        raise
