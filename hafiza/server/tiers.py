"""The `x-hafiza-tiers` response header: where a request's prompt K/V came from when a KV store is attached.

e.g. `decision=load; pool=0; disk=1984; computed=16; why=load: 28.95 MB from disk at 950 MB/s ~ 30.5 ms < ...`:
tokens from the engine's own pool, from each store tier, and computed; `decision` is load, recompute, miss (no
tier held the next block) or none (the tiers were not asked: the pool covered the prompt, or no lookup was
needed; `why` then says which). The value comes from the request's first output, which carries its admission's
tier outcome (`RequestOutput.tiers`).
"""

from __future__ import annotations

from hafiza.engine.connector import TierOutcome
from hafiza.engine.results import RequestOutput

HEADER = "x-hafiza-tiers"
_ASCII = str.maketrans({"≈": "~", "≤": "<=", "≥": ">=", "×": "x", "→": "->"})


def tiers_header(out: RequestOutput) -> str:
    """The `x-hafiza-tiers` value for a request's first output (ASCII only: HTTP headers are latin-1)."""
    t = out.tiers or TierOutcome(pool_tokens=out.num_cached_tokens)
    parts = [f"decision={t.decision}", f"pool={t.pool_tokens}"]
    parts += [f"{tier}={tokens}" for tier, tokens in t.per_tier.items()]
    parts.append(f"computed={out.num_prompt_tokens - out.num_cached_tokens}")
    if t.reason:
        parts.append(f"why={t.reason.translate(_ASCII)}")
    return "; ".join(parts).encode("ascii", "replace").decode()
