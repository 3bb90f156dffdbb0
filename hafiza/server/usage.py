"""Usage accounting: which breakpoints are cached (pins), and how a prompt's tokens split into read/write/input.

The rules (docs/SERVER.md states them for users):
- `cache_read` = the tokens the engine served from its prefix cache at admission (whole blocks, never the last
  prompt token), whatever the route and whatever the length.
- A breakpoint counts only if its prefix is at least `min_cache_tokens` long; it pins the full blocks of that
  prefix for its TTL. Shorter breakpoints are ignored (no error), as the Anthropic API does.
- `cache_write` = tokens up to the last counted breakpoint, rounded down to a whole block, minus `cache_read`
  (never negative): what this request newly wrote for a breakpoint. Tokens up to the last 1h breakpoint are
  1h writes, the rest 5m writes.
- `input` = prompt length - cache_read - cache_write, so the three always sum to the prompt length.
"""

from __future__ import annotations

from dataclasses import dataclass

from hafiza.engine.sequence import CachePin
from hafiza.server.prompt import Breakpoint
from hafiza.server.settings import TTL_SECONDS, PriceTable


@dataclass(frozen=True)
class CacheUsage:
    """One request's prompt tokens split the way the Anthropic API bills them."""

    input_tokens: int
    cache_read: int
    write_5m: int
    write_1h: int

    @property
    def cache_write(self) -> int:
        return self.write_5m + self.write_1h

    @property
    def prompt_tokens(self) -> int:
        return self.input_tokens + self.cache_read + self.cache_write

    def cost(self, prices: PriceTable) -> float:
        """Estimated price of the prompt under `prices` (per million tokens)."""
        units = (self.input_tokens + prices.read * self.cache_read + prices.write_5m * self.write_5m
                 + prices.write_1h * self.write_1h)
        return units * prices.input_per_mtok / 1e6

    def uncached_cost(self, prices: PriceTable) -> float:
        """The prompt's price had every token been billed at the input price."""
        return self.prompt_tokens * prices.input_per_mtok / 1e6

    def saved(self, prices: PriceTable) -> float:
        """What caching saved against the uncached price (negative when a write premium is not yet paid back)."""
        return self.uncached_cost(prices) - self.cost(prices)


def counted_breakpoints(breakpoints: list[Breakpoint], min_tokens: int) -> list[Breakpoint]:
    """The breakpoints long enough to cache."""
    return [b for b in breakpoints if b.tokens >= min_tokens and b.tokens > 0]


def pins_for(breakpoints: list[Breakpoint]) -> list[CachePin]:
    """One engine pin per counted breakpoint."""
    return [CachePin(b.tokens, TTL_SECONDS[b.ttl]) for b in breakpoints]


def anthropic_usage(prompt_tokens: int, cached: int, breakpoints: list[Breakpoint], block_size: int) -> CacheUsage:
    """Split a prompt per the rules above; `breakpoints` are the counted ones."""
    cached = max(0, min(cached, prompt_tokens))
    end = max((b.tokens // block_size * block_size for b in breakpoints), default=0)
    end_1h = max((b.tokens // block_size * block_size for b in breakpoints if b.ttl == "1h"), default=0)
    write = max(0, end - cached)
    write_1h = max(0, min(end_1h, end) - cached)
    return CacheUsage(prompt_tokens - cached - write, cached, write - write_1h, write_1h)


def openai_usage(prompt_tokens: int, cached: int) -> CacheUsage:
    """Automatic caching: reads only, never a billed write."""
    cached = max(0, min(cached, prompt_tokens))
    return CacheUsage(prompt_tokens - cached, cached, 0, 0)
