"""Errors of the lossy KV formats: bad values reaching a pool, unknown kinds."""

from hafiza.errors import HafizaError


class NonFiniteKVError(HafizaError):
    """A K or V written to a quantised pool holds inf or NaN: it cannot be scaled, so it is refused."""


class KVKindError(HafizaError):
    """An unknown --kv-dtype, or a pool option that does not fit the layout."""
