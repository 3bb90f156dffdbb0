"""One generation seen from the HTTP side: start it, read its outputs, time it, explain its cache use, and the
response headers that describe it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence

from fastapi import Request

from hafiza.engine.async_engine import EngineDeadError, EngineOverloadedError
from hafiza.engine.results import RequestOutput
from hafiza.engine.sampling import SamplingParams
from hafiza.engine.sequence import CachePin
from hafiza.errors import RequestError
from hafiza.server.choices import Choices
from hafiza.server.errors import ApiError, OverloadedError
from hafiza.server.explain import Explanation
from hafiza.server.prompt import Prompt
from hafiza.server.state import ServerState
from hafiza.server.streaming import ClientGone, DisconnectWatch, OutputStream
from hafiza.server.tiers import HEADER as TIERS_HEADER
from hafiza.server.tiers import tiers_header


class Generation:
    """Runs `prompt` on the engine for one HTTP request. Always `close()` it (it aborts an unfinished request).
    `cache_salt` is the request's cache partition (see `request_partition`): it keys its blocks in the pool and
    every tier, and the explainer compares it only with prompts of the same partition. `fields` renames the
    engine's request fields (SamplingParams names) to this API's, for a 400's `param`."""

    def __init__(self, state: ServerState, api: str, request: Request, prompt: Prompt, params: SamplingParams,
                 request_id: str, pins: Sequence[CachePin] = (), ignored_breakpoints: int = 0,
                 cache_salt: str | None = None, fields: Mapping[str, str] | None = None) -> None:
        self.state, self.api, self.request, self.prompt, self.params = state, api, request, prompt, params
        self.request_id, self.pins, self.ignored_breakpoints = request_id, list(pins), ignored_breakpoints
        self.cache_salt, self.fields = cache_salt, fields or {}
        self.stream: OutputStream | None = None
        self.explanation: Explanation | None = None
        self.first: RequestOutput | None = None
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
        """Check and queue the request (400 if it can never be served) and wait for its first output (the prompt
        is then fully computed)."""
        try:
            stream = await self.state.aengine.submit(self.prompt.ids, self.params, self.request_id,
                                                     self.cache_salt, self.pins)
        except RequestError as exc:
            raise self._bad_request(exc) from exc
        self.stream = OutputStream(stream, DisconnectWatch(self.request))
        first = await self.next()
        assert first is not None
        self.first = first
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
            raise self._bad_request(exc) from exc
        except EngineDeadError as exc:
            raise ApiError(500, str(exc)) from exc
        except EngineOverloadedError as exc:
            raise OverloadedError(str(exc), exc.retry_after_s) from exc
        if out is not None:
            self._observe(out)
        return out

    async def close(self) -> None:
        if self.stream is not None:
            await self.stream.close()

    def headers(self, id_header: str) -> dict[str, str]:
        """The response headers: `x-hafiza-cache`, the request id under `id_header`, and with a KV store attached
        `x-hafiza-tiers` (from the first output, which carries the admission's tier outcome)."""
        out = {"x-hafiza-cache": self.explanation.header() if self.explanation else "", id_header: self.request_id}
        if self.first is not None and self.state.aengine.engine.connector is not None:
            out[TIERS_HEADER] = tiers_header(self.first)
        return out

    def _bad_request(self, exc: RequestError) -> ApiError:
        param = self.fields.get(exc.param, exc.param) if exc.param is not None else None
        return ApiError(400, str(exc), param=param)

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


async def read_all(gen: Generation, choices: Choices) -> None:
    """Feed every output of a started generation to its choices until all n have finished."""
    out = gen.last
    while True:
        if out is not None:
            choices.feed(out)
        if choices.done:
            return
        out = await gen.next()


async def begin(runs: Sequence[tuple[Generation, Choices]], stream: bool) -> list[RequestOutput] | None:
    """Start every generation (together) and return their first outputs; unless `stream`, also read each to the
    end into its choices and close it. None when the client left (the route answers 499). Any failure closes
    them all; a streamed generation is closed by its response."""
    gens = [g for g, _ in runs]
    starts = [asyncio.ensure_future(g.start()) for g in gens]
    try:
        firsts = await asyncio.gather(*starts)
        if not stream:
            for gen, choices in runs:
                await read_all(gen, choices)
    except BaseException as exc:
        for task in starts:
            task.cancel()
        await asyncio.gather(*starts, return_exceptions=True)
        await close_all(gens)
        if isinstance(exc, ClientGone):
            return None
        raise
    if not stream:
        await close_all(gens)
    return list(firsts)


async def close_all(gens: Sequence[Generation]) -> None:
    """Close generations, even when the caller is being cancelled."""
    await asyncio.shield(asyncio.gather(*(g.close() for g in gens), return_exceptions=True))
