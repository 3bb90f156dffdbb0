"""Reading the store settings: sizes, a disk tier `DIR[:SIZE]`, a Redis URL, and the tier stack they build.

Sizes are read by `hafiza.sizes.parse_size`: Ki/Mi/Gi/Ti (or KiB…) are powers of 1024, K/M/G/T (or KB…) powers
of 1000, a bare number is bytes.

Redis URLs: `redis://[user:pass@]host:port[/db]`, `rediss://…` (TLS) or `unix:///path.sock` for one server;
`redis+cluster://host:port` (or `rediss+cluster://`, or any of the above with `?cluster=1`) for a Redis
Cluster, given one startup node. Extra query parameters: `prefix=` (key prefix, default "hafiza:") and
`ttl=` (default expiry in seconds when a put carries none; 0 or "none" for no expiry; default 300, the API's 5 min).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode, urlsplit

from hafiza.errors import ConfigError
from hafiza.sizes import SIZE_RE, parse_size
from hafiza.store.base import KVStore
from hafiza.store.disk import DiskStore
from hafiza.store.memory import MemoryStore
from hafiza.store.redis_store import DEFAULT_TTL_S, RedisStore
from hafiza.store.tiered import TieredStore

DEFAULT_DISK_BYTES = 10 * 1024**3


class StoreConfigError(ConfigError):
    """A store option that cannot be understood (bad size, bad URL)."""


@dataclass(frozen=True)
class DiskSpec:
    """A disk tier `DIR[:SIZE]` parsed."""

    path: str
    capacity_bytes: int


def parse_disk_spec(spec: str) -> DiskSpec:
    """Split off a trailing `:SIZE` when it reads as a size (so paths with colons still work)."""
    path, size = spec, DEFAULT_DISK_BYTES
    head, sep, tail = spec.rpartition(":")
    if sep and SIZE_RE.fullmatch(tail):
        path, size = head, parse_size(tail)
    if not path:
        raise StoreConfigError(f"disk tier {spec!r}: missing directory", setting="store_disk")
    return DiskSpec(path, size)


@dataclass(frozen=True)
class RedisSpec:
    """A Redis tier URL parsed: the URL for the client, whether it is a cluster, prefix and default TTL."""

    url: str
    cluster: bool
    prefix: str
    ttl_s: float | None


def parse_redis_url(url: str) -> RedisSpec:
    """Accept redis://, rediss://, unix://, their `+cluster` forms and `?cluster=1|prefix=|ttl=`."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    cluster = scheme.endswith("+cluster")
    scheme = scheme.removesuffix("+cluster")
    if scheme not in ("redis", "rediss", "unix"):
        raise StoreConfigError(f"Redis URL {url!r}: scheme must be redis://, rediss:// or unix://",
                               setting="store_redis")
    query, prefix, ttl_s = [], "hafiza:", DEFAULT_TTL_S
    for k, v in parse_qsl(parts.query, keep_blank_values=True):
        if k == "cluster":
            cluster = cluster or v.lower() in ("1", "true", "yes", "")
        elif k == "prefix":
            prefix = v
        elif k == "ttl":
            try:
                ttl_s = None if v.lower() in ("0", "none", "") else float(v)
            except ValueError:
                msg = f"Redis URL {url!r}: ttl={v!r} is not a number of seconds"
                raise StoreConfigError(msg, setting="store_redis") from None
            if ttl_s is not None and ttl_s < 0:
                raise StoreConfigError(f"Redis URL {url!r}: ttl must be >= 0", setting="store_redis")
        else:
            query.append((k, v))
    if cluster and scheme == "unix":
        raise StoreConfigError(f"Redis URL {url!r}: a cluster needs a host:port startup node", setting="store_redis")
    if scheme != "unix" and not parts.hostname:
        raise StoreConfigError(f"Redis URL {url!r}: missing host", setting="store_redis")
    rest = urlencode(query)
    clean = f"{scheme}://{parts.netloc}{parts.path}" + (f"?{rest}" if rest else "")
    return RedisSpec(clean, cluster, prefix, ttl_s)


def build_tiers(
    ram: str | None,
    disk: str | None,
    redis: str | None,
    *,
    write_back: bool = False,
    queue_size: int = 1024,
    fsync: bool = False,
) -> TieredStore:
    """The tier stack RAM → disk → Redis from the three CLI options (each optional)."""
    tiers: list[KVStore] = []
    if ram is not None:
        tiers.append(MemoryStore(parse_size(ram), name="ram"))
    if disk is not None:
        d = parse_disk_spec(disk)
        tiers.append(DiskStore(d.path, d.capacity_bytes, name="disk", fsync=fsync))
    if redis is not None:
        r = parse_redis_url(redis)
        store = RedisStore(r.url, cluster=r.cluster, prefix=r.prefix, default_ttl_s=r.ttl_s, name="redis")
        tiers.append(store)
    return TieredStore(tiers, write_back=write_back and ram is not None, queue_size=queue_size)
