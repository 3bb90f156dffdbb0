"""Load or recompute: bytes over each tier's measured bandwidth (+ decode, + the speculative codec's predictor
rerun) against tokens over measured prefill speed.

Three plans per admission: load and decode; load, rerun the predictor on the prefix tokens and decode
(`predict_tokens` > 0, the speculative codec); or recompute. Bandwidth per tier is an exponential moving
average of observed loads, kept as averages of bytes and of seconds separately (their ratio is a throughput,
not an average of noisy per-call rates). Before the first observation a tier uses a conservative default for
its kind. Prefill speed, decode time and predictor speed are measured by the caller (`observe_prefill`, the
connector's decode timing, `observe_predict`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

# Conservative first guesses (bytes/s) until a tier has been measured: well below what this machine does.
DEFAULT_BANDWIDTH: dict[str, float] = {"memory": 1e9, "disk": 100e6, "redis": 50e6}
FALLBACK_BANDWIDTH = 50e6


@dataclass(frozen=True)
class LoadDecision:
    """Whether to load a cached prefix, the estimates behind it, and a sentence saying why."""

    load: bool
    reason: str
    load_s: float
    recompute_s: float | None
    plan: str = "load"  # "load" (load and decode), "predict" (load, rerun the predictor, decode) or "recompute"


@dataclass
class _Rate:
    bytes: float = 0.0
    seconds: float = 0.0
    samples: int = 0


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f} MB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


class CostModel:
    """Thread-safe bandwidth and prefill-speed estimates with a `decide` that explains itself."""

    def __init__(self, alpha: float = 0.2, margin: float = 1.0, defaults: Mapping[str, float] | None = None):
        if not 0 < alpha <= 1 or margin <= 0:
            raise ValueError(f"alpha={alpha} must be in (0, 1] and margin={margin} > 0")
        self.alpha = alpha
        self.margin = margin
        self.defaults = dict(DEFAULT_BANDWIDTH if defaults is None else defaults)
        self._kinds: dict[str, str] = {}
        self._rates: dict[str, _Rate] = {}
        self._prefill = _Rate()
        self._predict = _Rate()
        self._prefill_contended = _Rate()
        self._predict_contended = _Rate()
        self._lock = threading.Lock()

    def add_tier(self, name: str, kind: str) -> None:
        """Register a tier so it gets its kind's default bandwidth before any measurement."""
        with self._lock:
            self._kinds[name] = kind
            self._rates.setdefault(name, _Rate())

    def _update(self, rate: _Rate, amount: float, seconds: float) -> None:
        a = 1.0 if rate.samples == 0 else self.alpha
        rate.bytes += a * (amount - rate.bytes)
        rate.seconds += a * (seconds - rate.seconds)
        rate.samples += 1

    def observe_load(self, tier: str, nbytes: int, seconds: float) -> None:
        """Record one load of `nbytes` from `tier` that took `seconds`."""
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            self._update(self._rates.setdefault(tier, _Rate()), nbytes, seconds)

    def observe_prefill(self, num_tokens: int, seconds: float, contended: bool = False) -> None:
        """Record one prefill of `num_tokens` that took `seconds` (the recompute alternative). `contended`: the
        store's writer was encoding meanwhile; such samples are used only until a quiet one exists."""
        if num_tokens <= 0 or seconds <= 0:
            return
        with self._lock:
            self._update(self._prefill_contended if contended else self._prefill, num_tokens, seconds)

    def observe_predict(self, num_tokens: int, seconds: float, contended: bool = False) -> None:
        """Record one predictor run over `num_tokens` that took `seconds` (the speculative codec's extra cost).
        `contended`: the engine was serving meanwhile (used only until a quiet sample exists)."""
        if num_tokens <= 0 or seconds <= 0:
            return
        with self._lock:
            self._update(self._predict_contended if contended else self._predict, num_tokens, seconds)

    @staticmethod
    def _quiet_first(quiet: _Rate, contended: _Rate) -> float | None:
        """The quiet rate once measured, else the contended one, else None."""
        for r in (quiet, contended):
            if r.samples:
                return r.bytes / r.seconds
        return None

    def predict_rate(self) -> float | None:
        """Measured predictor tokens/s (quiet samples first), or None before any measurement."""
        with self._lock:
            return self._quiet_first(self._predict, self._predict_contended)

    def set_prefill_rate(self, tokens_per_s: float) -> None:
        """Replace the prefill estimate with a known speed."""
        if tokens_per_s <= 0:
            raise ValueError(f"tokens_per_s={tokens_per_s} must be > 0")
        with self._lock:
            self._prefill = _Rate(tokens_per_s, 1.0, 1)

    def set_predict_rate(self, tokens_per_s: float) -> None:
        """Replace the predictor-speed estimate with a known speed."""
        if tokens_per_s <= 0:
            raise ValueError(f"tokens_per_s={tokens_per_s} must be > 0")
        with self._lock:
            self._predict = _Rate(tokens_per_s, 1.0, 1)

    def bandwidth(self, tier: str) -> tuple[float, bool]:
        """(bytes/s, measured?) for a tier; unmeasured tiers get their kind's default."""
        with self._lock:
            r = self._rates.get(tier)
            if r is not None and r.samples:
                return r.bytes / r.seconds, True
            return self.defaults.get(self._kinds.get(tier, ""), FALLBACK_BANDWIDTH), False

    def prefill_rate(self) -> float | None:
        """Measured prefill tokens/s (quiet samples first), or None before any measurement."""
        with self._lock:
            return self._quiet_first(self._prefill, self._prefill_contended)

    def decide(self, num_tokens: int, bytes_by_tier: Mapping[str, int], decode_s: float = 0.0,
               predict_tokens: int = 0) -> LoadDecision:
        """Load when Σ bytes/bandwidth + `decode_s` (+ `predict_tokens` / predictor speed) × margin < num_tokens /
        prefill speed; `plan` is "predict" when the load reruns the predictor."""
        if num_tokens <= 0:
            return LoadDecision(False, "nothing cached to load", 0.0, 0.0, "recompute")
        load_s = decode_s
        parts = []
        for tier, nbytes in bytes_by_tier.items():
            if nbytes <= 0:
                continue
            bw, measured = self.bandwidth(tier)
            load_s += nbytes / bw
            note = "" if measured else " (default)"
            parts.append(f"{_mb(nbytes)} from {tier} at {bw / 1e6:.0f} MB/s{note}")
        loading = ", ".join(parts) or "0 bytes"
        if decode_s > 0:
            loading += f" + decode {_ms(decode_s)}"
        plan = "load"
        if predict_tokens > 0:
            plan = "predict"
            prate = self.predict_rate()
            if prate is None:
                loading += f" + predictor on {predict_tokens} tokens (speed not measured yet)"
            else:
                predict_s = predict_tokens / prate
                load_s += predict_s
                loading += f" + predictor on {predict_tokens} tokens at {prate:.0f} tok/s ≈ {_ms(predict_s)}"
        loading += f" ≈ {_ms(load_s)}"
        word = "load: predict+decode" if plan == "predict" else "load"
        rate = self.prefill_rate()
        if rate is None:
            return LoadDecision(True, f"{word}: prefill speed not measured yet; {loading}", load_s, None, plan)
        recompute_s = num_tokens / rate
        recompute = f"recompute {num_tokens} tokens at {rate:.0f} tok/s ≈ {_ms(recompute_s)}"
        if load_s * self.margin < recompute_s:
            return LoadDecision(True, f"{word}: {loading} < {recompute}", load_s, recompute_s, plan)
        return LoadDecision(False, f"recompute: {recompute} ≤ {loading}", load_s, recompute_s, "recompute")
