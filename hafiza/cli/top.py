"""`hafiza top`: the dashboard's picture in the terminal, read from a running server's /metrics (rich Live).

KV usage, blocks by state, prefix hit rate, TTFT, tok/s, requests, preemptions and store tiers come from the
Prometheus text (parsed with prometheus_client's parser); the largest cached prefixes come from
/dashboard/state when the server allows it (send `--api-key` if it has one).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from hafiza import settings
from hafiza.cli import app
from hafiza.errors import HafizaError

BAR_WIDTH = 40
STATE_STYLES = (("in_use", "dark_orange"), ("cached", "dodger_blue2"), ("free", "grey50"))


@dataclass
class Scrape:
    """One /metrics read: every `hafiza:` sample by name, as (labels, value) pairs, and when it was taken."""

    at: float
    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=lambda: defaultdict(list))

    def value(self, name: str, **labels: str) -> float | None:
        """The sum of the samples of `name` whose labels include `labels` (None if there are none)."""
        found = [v for lab, v in self.samples.get(f"hafiza:{name}", []) if all(lab.get(k) == x for k, x in
                                                                              labels.items())]
        return sum(found) if found else None

    def by(self, name: str, label: str) -> dict[str, float]:
        """Samples of `name` keyed by one label's value (summed over the other labels)."""
        out: dict[str, float] = defaultdict(float)
        for lab, v in self.samples.get(f"hafiza:{name}", []):
            if label in lab:
                out[lab[label]] += v
        return dict(out)


def parse_metrics(text: str, at: float | None = None) -> Scrape:
    """Parse Prometheus exposition text, keeping the `hafiza:` samples."""
    from prometheus_client.parser import text_string_to_metric_families

    scrape = Scrape(time.time() if at is None else at)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("hafiza:"):
                scrape.samples[s.name].append((dict(s.labels), float(s.value)))
    return scrape


class Source:
    """Reads a hafiza server: /metrics, and /dashboard/state for the prefix table."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        headers = {"x-api-key": api_key, "authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def scrape(self) -> Scrape:
        try:
            r = self.client.get("/metrics")
        except httpx.HTTPError as exc:
            raise HafizaError(f"cannot reach a hafiza server at {self.url}: {_reason(exc)}") from exc
        if r.status_code != 200:
            raise HafizaError(f"{self.url}/metrics answered HTTP {r.status_code}")
        scrape = parse_metrics(r.text)
        if scrape.value("kv_blocks_total") is None:
            raise HafizaError(f"{self.url}/metrics has no hafiza: metrics (is it a hafiza server?)")
        return scrape

    def prefixes(self, limit: int = 10) -> dict[str, Any] | str:
        """The dashboard's prefix table, or why it is not available."""
        try:
            r = self.client.get("/dashboard/state", params={"limit": limit})
        except httpx.HTTPError as exc:
            return f"unavailable: {_reason(exc)}"
        if r.status_code == 401:
            return "the server has an API key: pass --api-key to see them"
        if r.status_code != 200:
            return f"unavailable (HTTP {r.status_code})"
        return r.json()

    def close(self) -> None:
        self.client.close()


def _reason(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    return "connection refused" if "refused" in text.lower() else text.splitlines()[0]


def _delta(now: Scrape, before: Scrape | None, name: str) -> float | None:
    if before is None:
        return None
    a, b = now.value(name), before.value(name)
    return None if a is None or b is None else a - b


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _fmt_s(v: float | None) -> str:
    return "–" if v is None else (f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s")


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f} %"


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def blocks_bar(counts: dict[str, float], total: float) -> Text:
    """A bar of the pool: in use, cached and free blocks in proportion."""
    bar = Text()
    used = 0
    for state, style in STATE_STYLES:
        cells = round(BAR_WIDTH * counts.get(state, 0) / total) if total else 0
        cells = min(cells, BAR_WIDTH - used) if state != "free" else BAR_WIDTH - used
        bar.append("█" * cells, style=style)
        used += cells
    return bar


def engine_table(now: Scrape, before: Scrape | None) -> Table:
    """KV pool, prefix cache, latency, throughput and queue figures."""
    blocks = now.by("kv_blocks", "state")
    total = now.value("kv_blocks_total") or 0
    bpb = now.value("kv_bytes_per_block") or 0
    queries, hits = now.value("prefix_cache_queries_total"), now.value("prefix_cache_hits_total")
    dt = now.at - before.at if before else None
    gen = _delta(now, before, "generation_tokens_total")
    ttft_n = _delta(now, before, "time_to_first_token_seconds_count")
    ttft_sum = _delta(now, before, "time_to_first_token_seconds_sum")
    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    usage = now.value("kv_cache_usage_perc")
    table.add_row("KV in use", f"{_pct(usage)} of {total:.0f} blocks x {now.value('kv_block_size_tokens') or 0:.0f} "
                               f"tokens ({_fmt_bytes(total * bpb)})")
    table.add_row("blocks", blocks_bar(blocks, total))
    table.add_row("", "  ".join(f"{state.replace('_', ' ')} {blocks.get(state, 0):.0f}"
                                for state in ("free", "cached", "in_use", "pinned")))
    interval = _ratio(_delta(now, before, "prefix_cache_hits_total"), _delta(now, before, "prefix_cache_queries_total"))
    table.add_row("prefix hit rate", f"{_pct(_ratio(hits, queries))} since start ({hits or 0:.0f} of "
                                     f"{queries or 0:.0f} prompt tokens)"
                                     + (f", {_pct(interval)} in the last {dt:.0f} s" if interval is not None and dt
                                        else ""))
    mean_ttft = _ratio(now.value("time_to_first_token_seconds_sum"), now.value("time_to_first_token_seconds_count"))
    recent = _ratio(ttft_sum, ttft_n)
    table.add_row("TTFT", f"{_fmt_s(recent)} last interval, {_fmt_s(mean_ttft)} mean since start"
                  if recent is not None else f"{_fmt_s(mean_ttft)} mean since start")
    rate = gen / dt if gen is not None and dt else None
    rate_text = f"{rate:.1f}" if rate is not None else "–"
    table.add_row("tokens/s", f"{rate_text} ({now.value('generation_tokens_total') or 0:.0f} generated since start)")
    table.add_row("requests", f"{now.value('num_requests_running') or 0:.0f} running, "
                              f"{now.value('num_requests_waiting') or 0:.0f} waiting")
    table.add_row("preemptions", f"{now.value('num_preemptions_total') or 0:.0f}   evictions "
                                 f"{now.value('kv_evictions_total') or 0:.0f} (pinned "
                                 f"{now.value('kv_pinned_evictions_total') or 0:.0f})")
    saved = now.value("cache_cost_saved")
    if saved is not None:
        table.add_row("cache savings", f"{saved:.4f} (price table units)")
    return table


def tiers_table(now: Scrape, before: Scrape | None) -> Table | None:
    """Store tiers: bytes, entries, hit rates, compression; None when the server has no store."""
    tiers = now.by("store_enabled", "tier")
    if not tiers:
        return None
    table = Table(title="store tiers", title_justify="left")
    for col in ("tier", "bytes", "capacity", "entries", "hit rate", "compression", "state"):
        table.add_column(col, justify="left" if col == "tier" else "right")
    for tier in tiers:
        hits, misses = now.value("store_hits_total", tier=tier), now.value("store_misses_total", tier=tier)
        rate = _ratio(hits, (hits or 0) + (misses or 0))
        ratio = now.value("store_compression_ratio", tier=tier)
        degraded = now.value("store_degraded", tier=tier)
        table.add_row(tier, _fmt_bytes(now.value("store_bytes", tier=tier)),
                      _fmt_bytes(now.value("store_capacity_bytes", tier=tier)),
                      f"{now.value('store_entries', tier=tier) or 0:.0f}", _pct(rate),
                      f"{ratio:.2f}x" if ratio else "–", "unreachable" if degraded else "ok")
    return table


def prefixes_table(state: dict[str, Any] | str) -> RenderableType:
    """The largest cached prefixes with their pins and TTLs (or why they are not shown)."""
    if isinstance(state, str):
        return Text(f"cached prefixes: {state}", style="dim")
    table = Table(title=f"largest cached prefixes ({state['count']} listed)", title_justify="left")
    for col in ("prefix", "tokens", "shared", "in use", "pinned", "TTL left", "requests"):
        table.add_column(col, justify="left" if col == "prefix" else "right", overflow="ellipsis",
                         no_wrap=col == "prefix", max_width=60 if col == "prefix" else None)
    for p in state["prefixes"]:
        if p["head"] is None:  # the server shows prompt text to its admin key only
            head, tail = "(text needs the admin key)", ""
        else:
            head, tail = " ".join(p["head"].split()), " ".join(p["tail"].split())
        preview = f"{head[:24]} … {tail[-32:]}" if tail else head
        ttl = "–" if p["ttl_left_s"] is None else f"{p['ttl_left_s']:.0f} s"
        table.add_row(preview, str(p["tokens"]), str(p["shared_tokens"]), str(p["in_use_blocks"] or "–"),
                      str(p["pinned_blocks"] or "–"), ttl, str(p["requests"]))
    return table


def frame(url: str, now: Scrape, before: Scrape | None, prefixes: dict[str, Any] | str | None) -> RenderableType:
    """One screen: header, engine figures, tiers, prefixes."""
    header = Text.assemble(("hafiza top", "bold"), f"  {url}  ", (time.strftime("%H:%M:%S"), "dim"))
    parts: list[RenderableType] = [header, engine_table(now, before)]
    tiers = tiers_table(now, before)
    if tiers is not None:
        parts.append(tiers)
    if prefixes is not None:
        parts.append(prefixes_table(prefixes))
    return Group(*parts)


@app.command()
def top(
    url: Annotated[str, typer.Option(help="The hafiza server.")] = "http://127.0.0.1:8000",
    once: Annotated[bool, typer.Option("--once", help="Print one frame and exit.")] = False,
    api_key: Annotated[str | None, typer.Option(help="The server's key (its admin key shows prompt text).",
                                                envvar=settings.API_KEY.name)] = None,
    interval: Annotated[float, typer.Option(help="Seconds between refreshes (and between the two reads of "
                                                 "--once, for the rates).")] = 1.0,
) -> None:
    """Watch a running server's KV cache live in the terminal (Ctrl-C to quit)."""
    from rich.live import Live

    if interval <= 0:
        raise HafizaError("--interval must be positive")
    source = Source(url, api_key)
    console = Console()
    try:
        before = source.scrape()
        if once:
            time.sleep(interval)
            console.print(frame(source.url, source.scrape(), before, source.prefixes()))
            return
        with Live(frame(source.url, before, None, source.prefixes()), console=console, auto_refresh=False,
                  screen=False) as live:
            while True:
                time.sleep(interval)
                try:
                    now = source.scrape()
                except HafizaError as exc:
                    live.update(Text(f"{exc} (retrying)", style="red"), refresh=True)
                    continue
                live.update(frame(source.url, now, before, source.prefixes()), refresh=True)
                before = now
    except KeyboardInterrupt:
        pass
    finally:
        source.close()
