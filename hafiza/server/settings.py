"""Server settings: what `hafiza serve` passes to `create_app`, independent of the engine's own knobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from hafiza.errors import ConfigError, HafizaError

TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}
CHARS_PER_CONTEXT_TOKEN = 32
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
MAX_CACHE_SALT_CHARS = 256


class Access(StrEnum):
    """Who may read an endpoint: anyone, any API key (anyone when the server has none), or the admin key."""

    NONE = "none"
    API = "api"
    ADMIN = "admin"


def read_keys_file(path: str | Path) -> tuple[str, ...]:
    """API keys from a file: one per line; blank lines and lines starting with '#' are skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"keys file {path}: cannot read it ({exc})", setting="api_keys_file") from exc
    keys = tuple(k for k in (line.strip() for line in lines) if k and not k.startswith("#"))
    if not keys:
        raise ConfigError(f"keys file {path}: no keys in it (one per line)", setting="api_keys_file")
    return keys


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
                raise ConfigError(f"cannot read {item!r}: use keys {', '.join(cls.__dataclass_fields__)}",
                                  setting="prices")
            try:
                values[key] = float(value)
            except ValueError as exc:
                raise ConfigError(f"{key} must be a number, got {value!r}", setting="prices") from exc
            if values[key] < 0:
                raise ConfigError(f"{key} must be >= 0, got {value}", setting="prices")
        return cls(**values)


@dataclass
class ServerSettings:
    """HTTP-side configuration. `model_name` is the id clients send; `aliases` are accepted too.

    Keys and roles: `api_key` and `api_keys` are API keys (with two or more, each key is its own cache partition
    unless `shared_cache`); `admin_key` alone may act on the dashboard and read cached prompt text. With no key at
    all the server is open and every caller is admin (loopback use); the Host allow-list and the same-origin
    check still apply. `explain_details` lets `x-hafiza-cache` name the other request and the offset it compared
    with (within the caller's partition)."""

    model_name: str = "default"
    aliases: tuple[str, ...] = ()
    api_key: str | None = None
    api_keys: tuple[str, ...] = ()
    admin_key: str | None = None
    shared_cache: bool = False
    explain_details: bool = False
    allowed_hosts: tuple[str, ...] = LOCAL_HOSTS
    cors_origins: tuple[str, ...] = ()
    metrics_auth: Access = Access.NONE
    dashboard_auth: Access = Access.API
    min_cache_tokens: int = 1024
    max_body_bytes: int = 8 * 2**20
    prices: PriceTable = field(default_factory=PriceTable)
    explain_history: int = 256
    ping_interval_s: float = 10.0
    max_messages: int = 10_000
    max_prompt_chars: int | None = None  # None: CHARS_PER_CONTEXT_TOKEN per token of the model's context
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    allow_special_tokens_in_content: bool = False

    def __post_init__(self) -> None:
        keys = self.keys
        if any(not k for k in keys) or self.admin_key == "":
            raise HafizaError("API and admin keys must not be empty")
        if self.admin_key is not None and self.admin_key in keys:
            raise ConfigError("the admin key must differ from every API key (an API key would be an admin)",
                              setting="admin_key")
        self.metrics_auth, self.dashboard_auth = Access(self.metrics_auth), Access(self.dashboard_auth)
        for what, level in (("metrics_auth", self.metrics_auth), ("dashboard_auth", self.dashboard_auth)):
            if level is Access.ADMIN and self.admin_key is None and not self.is_open:
                raise ConfigError(f"{what} admin needs an admin key", setting=what)
        self.cors_origins = tuple(o.rstrip("/") for o in self.cors_origins)
        self.allowed_hosts = tuple(h.lower().strip("[]") for h in self.allowed_hosts)

    @property
    def keys(self) -> tuple[str, ...]:
        """Every API key, `api_key` first, without repeats."""
        return tuple(dict.fromkeys([*([self.api_key] if self.api_key is not None else []), *self.api_keys]))

    @property
    def is_open(self) -> bool:
        """No key of any kind: every caller may do everything (meant for a loopback-only server)."""
        return not self.keys and self.admin_key is None

    @property
    def partition_by_key(self) -> bool:
        """Each API key is its own cache partition: with two or more keys, unless `shared_cache`."""
        return len(self.keys) > 1 and not self.shared_cache

    def accepts_model(self, name: str) -> bool:
        return name == self.model_name or name in self.aliases
