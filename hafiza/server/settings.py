"""Server settings: what `hafiza serve` passes to `create_app`, independent of the engine's own knobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from hafiza.errors import HafizaError

TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}


@dataclass(frozen=True)
class PriceTable:
    """Prices for the cache-savings estimate: input price per million tokens and multipliers of it."""

    input_per_mtok: float = 3.0
    write_5m: float = 1.25
    write_1h: float = 2.0
    read: float = 0.1

    @classmethod
    def parse(cls, text: str | None) -> PriceTable:
        """Read 'input_per_mtok=3,read=0.1,write_5m=1.25,write_1h=2' (any subset; the rest keep their defaults)."""
        if not text:
            return cls()
        values: dict[str, float] = {}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in cls.__dataclass_fields__:
                raise HafizaError(f"--prices: cannot read {item!r}: use keys {', '.join(cls.__dataclass_fields__)}")
            try:
                values[key] = float(value)
            except ValueError as exc:
                raise HafizaError(f"--prices: {key} must be a number, got {value!r}") from exc
            if values[key] < 0:
                raise HafizaError(f"--prices: {key} must be >= 0, got {value}")
        return cls(**values)


@dataclass
class ServerSettings:
    """HTTP-side configuration. `model_name` is the id clients send; `aliases` are accepted too."""

    model_name: str = "default"
    aliases: tuple[str, ...] = ()
    api_key: str | None = None
    min_cache_tokens: int = 1024
    max_body_bytes: int = 8 * 2**20
    prices: PriceTable = field(default_factory=PriceTable)
    explain_history: int = 256
    ping_interval_s: float = 10.0

    def accepts_model(self, name: str) -> bool:
        return name == self.model_name or name in self.aliases
