"""Errors of the KV pool: bad values reaching a lossy format, unknown storage dtypes, eviction settings."""

from hafiza.errors import ConfigError, HafizaError


class NonFiniteKVError(HafizaError):
    """A K or V written to a quantised pool holds inf or NaN: it cannot be scaled, so it is refused."""


class KVDtypeError(ConfigError):
    """An unknown KV storage dtype, or a pool option that does not fit the layout."""


class EvictionError(ConfigError):
    """An unknown eviction policy, or a KV token budget too small for the policy to keep anything useful."""
