"""`hafiza serve --store-*`: the options, checked before the model loads, and the connector they build, attached
to the engine before its thread starts."""

from __future__ import annotations

from dataclasses import dataclass

from hafiza.engine.engine import LLMEngine
from hafiza.errors import ConfigError
from hafiza.store.codecs import DEFAULT_STORE_CODEC, check_codec
from hafiza.store.config import StoreConfigError, build_tiers, parse_disk_spec, parse_redis_url, parse_size
from hafiza.store.connector import StoreConnector
from hafiza.store.redis_store import DEFAULT_TTL_S


@dataclass(frozen=True)
class StoreOptions:
    """The `hafiza serve --store-*` options."""

    ram: str | None = None
    disk: str | None = None
    redis: str | None = None
    codec: str = DEFAULT_STORE_CODEC
    write_back: bool = False
    tier_codecs: tuple[tuple[str, str], ...] = ()  # (tier name, codec) where a tier differs from `codec`

    @property
    def enabled(self) -> bool:
        return any(x is not None for x in (self.ram, self.disk, self.redis))

    def validate(self) -> None:
        """Raise a one-line HafizaError for a bad option, before the model is loaded."""
        check_codec(self.codec)
        for tier, codec in self.tier_codecs:
            try:
                check_codec(codec)
            except ConfigError as exc:
                raise StoreConfigError(str(exc), setting=f"store_{tier}_codec") from None
            if getattr(self, tier) is None:
                raise StoreConfigError(f"--store-{tier}-codec needs --store-{tier}")
        if self.write_back and len({c for _, c in self.tier_codecs} | {self.codec}) > 1:
            raise StoreConfigError("--store-write-back needs one codec for every tier (RAM entries are written "
                                   "down as they are)")
        if self.ram is not None:
            try:
                parse_size(self.ram)
            except ConfigError as exc:
                raise StoreConfigError(f"RAM tier: {exc}", setting="store_ram") from None
        if self.disk is not None:
            parse_disk_spec(self.disk)
        if self.redis is not None:
            parse_redis_url(self.redis)
        if self.write_back and self.ram is None:
            raise StoreConfigError("--store-write-back needs --store-ram (blocks wait in RAM until written down)")


def connect_store(engine: LLMEngine, options: StoreOptions) -> StoreConnector:
    """Build the tiers and attach a connector to `engine`; call it before the engine's thread starts (only that
    thread touches the engine afterwards)."""
    options.validate()
    store = build_tiers(options.ram, options.disk, options.redis, write_back=options.write_back)
    ttl = parse_redis_url(options.redis).ttl_s if options.redis else DEFAULT_TTL_S
    connector = StoreConnector.for_engine(engine, store, codec=options.codec, tier_codecs=dict(options.tier_codecs),
                                          default_ttl_s=ttl)
    engine.attach_connector(connector)
    return connector
