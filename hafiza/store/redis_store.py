"""Redis/Valkey tier, shared between server instances: framed values under a key prefix, TTL per put.

Works against one server (`redis.Redis`) or a Redis Cluster (`redis.cluster.RedisCluster`). The client never
retries inside a call (that would stall the engine); instead a failed call marks the tier `degraded`, logs
one warning, and for `retry_interval_s` every operation answers at once as a miss (put: False). The next
call after that interval rebuilds the client and probes: PING, or on a cluster every master must answer and
report cluster_state:ok (so a cluster with one master down stays degraded until it is back or failed over,
instead of flapping); success clears `degraded` and logs it.

No method raises, whatever the client throws: a command the server refused (ResponseError, e.g. OOM under
`noeviction`) is counted as an error; anything else (connection and auth errors, and the ValueError or
AttributeError a socket closed under another thread gives) is an outage. Dropping a client closes only its
idle connections, so a thread still using one of them is not cut off mid-read. Repeated log lines go through
the store's rate limiter (logs.py).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import ClusterDownError, DataError, ResponseError, TryAgainError
from redis.retry import Retry

from hafiza.store.base import KVStore
from hafiza.store.frame import FrameError, pack, unpack
from hafiza.store.logs import store_log
from hafiza.store.stats import StoreCounters, StoreStats

T = TypeVar("T")
DEFAULT_TTL_S = 300.0  # the prompt-caching APIs' default TTL (5 min); pinned 1 h blocks carry their own


class _Unavailable(Exception):
    """The server is (still) unreachable; the operation answers as a miss."""


class _Refused(Exception):
    """The server answered but refused the command (e.g. OOM); counted as an error, the tier stays up."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


def _is_outage(e: BaseException) -> bool:
    """Anything but a refused command degrades the tier (connection, auth, a socket closed mid-read)."""
    if isinstance(e, ClusterDownError | TryAgainError):
        return True
    return not isinstance(e, ResponseError | DataError)


def _glob_escape(s: str) -> str:
    """Escape Redis MATCH pattern characters in a literal prefix."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


class RedisStore(KVStore):
    """A KVStore on a Redis/Valkey server or cluster; see the module docstring for failure behaviour."""

    kind = "redis"

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        cluster: bool = False,
        prefix: str = "hafiza:",
        default_ttl_s: float | None = DEFAULT_TTL_S,
        name: str = "redis",
        socket_timeout_s: float = 2.0,
        connect_timeout_s: float = 0.5,
        retry_interval_s: float = 2.0,
    ):
        self.name = name
        self.url = url
        self.cluster = cluster
        self.prefix = prefix
        self.default_ttl_s = default_ttl_s
        self.socket_timeout_s = socket_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retry_interval_s = retry_interval_s
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._counters = StoreCounters()
        self._degraded = False
        self._next_probe = 0.0
        self._closed = False
        self.outages = 0

    # -- connection handling -----------------------------------------------------------------------------

    def _make_client(self) -> Any:
        """A client that fails fast: no retries or backoff inside a call."""
        opts: dict[str, Any] = {
            "socket_timeout": self.socket_timeout_s,
            "socket_connect_timeout": self.connect_timeout_s,
            "socket_read_size": 1 << 20,  # KV blocks are hundreds of KB: fewer, larger reads
            "retry": Retry(NoBackoff(), 0),
        }
        if self.cluster:
            return RedisCluster.from_url(self.url, **opts)
        return redis.Redis.from_url(self.url, **opts)

    def _drop_client(self, everything: bool = False) -> None:
        """Forget the client so the next probe starts from a fresh connection (and cluster topology).

        Only idle connections are closed (all of them with `everything`, at `close()`): another thread may
        be reading from one right now, and closing it under that thread is what raised ValueError before.
        A connection still in use goes back to the orphaned pool and is closed when the pool is collected.
        """
        with self._client_lock:
            client, self._client = self._client, None
        if client is None:
            return
        with contextlib.suppress(Exception):  # closing a broken client must not mask the outage
            if everything:
                client.close()
            elif self.cluster:
                for node in client.get_nodes():
                    if node.redis_connection is not None:
                        node.redis_connection.connection_pool.disconnect(inuse_connections=False)
            else:
                client.connection_pool.disconnect(inuse_connections=False)

    def _probe(self, client: Any) -> None:
        """PING the server; on a cluster every master must answer and report cluster_state:ok."""
        if not self.cluster:
            client.ping()
            return
        infos = client.cluster_info(target_nodes=RedisCluster.PRIMARIES)
        for info in [infos] if "cluster_state" in infos else infos.values():
            if info.get("cluster_state") != "ok":
                raise ClusterDownError(f"cluster_state is {info.get('cluster_state')!r}")

    def _run(self, fn: Callable[[Any], T]) -> T:
        """Run one command, tracking outages.

        Raises only `_Unavailable` (the server cannot answer: the operation is a miss) or `_Refused` (it
        answered with an error), whatever exception class the client raised.
        """
        probing = self._degraded
        if self._closed or (probing and time.monotonic() < self._next_probe):
            raise _Unavailable
        try:
            with self._client_lock:
                if self._client is None:
                    self._client = self._make_client()
                client = self._client
            if probing:
                self._probe(client)
            result = fn(client)
        except Exception as e:
            if not _is_outage(e):
                raise _Refused(e) from e
            self._counters.error()
            self._next_probe = time.monotonic() + self.retry_interval_s
            if not self._degraded:
                self._degraded = True
                self.outages += 1
                store_log.warning(
                    f"redis {self.name} {self.url} degraded",
                    "store tier %s degraded: %s unreachable (%s: %s); answering misses, retry every %.1f s",
                    self.name, self.url, type(e).__name__, e, self.retry_interval_s,
                )  # fmt: skip
            self._drop_client()
            raise _Unavailable from e
        if self._degraded:
            self._degraded = False
            store_log.warning(
                f"redis {self.name} {self.url} reconnected", "store tier %s reconnected to %s", self.name, self.url
            )
        return result

    def _refused(self, what: str, e: _Refused) -> None:
        """Count a refused command and log it, at most once per interval for this tier and command."""
        self._counters.error()
        store_log.warning(f"redis {self.name} {self.url} {what}", "store %s: %s refused: %s", self.name, what, e)

    def _k(self, key: str) -> str:
        return self.prefix + key

    def _pipeline(self, client: Any) -> Any:
        return client.pipeline() if self.cluster else client.pipeline(transaction=False)

    # -- KVStore -----------------------------------------------------------------------------------------

    def put(self, key: str, value: bytes, ttl_s: float | None = None) -> bool:
        """SET the framed value with PX = ttl_s (or the default TTL)."""
        t0 = time.perf_counter()
        ttl = ttl_s if ttl_s is not None else self.default_ttl_s
        px = max(1, round(ttl * 1000)) if ttl is not None else None
        data = pack(key, value)
        try:
            self._run(lambda c: c.set(self._k(key), data, px=px))
        except _Unavailable:
            self._counters.reject()
            return False
        except _Refused as e:
            self._refused("SET", e)
            return False
        self._counters.put(len(data), time.perf_counter() - t0)
        return True

    def _accept(self, key: str, data: bytes | None, seconds: float) -> bytes | None:
        """Verify one fetched value; a damaged one is deleted and counted as an error and a miss."""
        if data is None:
            self._counters.miss()
            return None
        try:
            payload = unpack(key, data)
        except FrameError as e:
            store_log.warning(
                f"redis {self.name} {self.url} damaged", "store %s: dropped damaged entry %s: %s", self.name, key, e
            )
            self._counters.error()
            self._counters.miss()
            self.delete(key)
            return None
        self._counters.hit(len(data), seconds)
        return payload

    def get(self, key: str) -> bytes | None:
        t0 = time.perf_counter()
        try:
            data = self._run(lambda c: c.get(self._k(key)))
        except _Unavailable:
            self._counters.miss()
            return None
        except _Refused as e:
            self._refused("GET", e)
            self._counters.miss()
            return None
        return self._accept(key, data, time.perf_counter() - t0)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """One pipelined round trip (per node on a cluster) for all keys."""
        if not keys:
            return []
        t0 = time.perf_counter()

        def fetch(c: Any) -> list[Any]:
            p = self._pipeline(c)
            for k in keys:
                p.get(self._k(k))
            return p.execute()

        try:
            values = self._run(fetch)
        except _Unavailable:
            self._counters.miss(len(keys))
            return [None] * len(keys)
        except _Refused as e:
            self._refused("pipelined GET", e)
            self._counters.miss(len(keys))
            return [None] * len(keys)
        per_key_s = (time.perf_counter() - t0) / len(keys)
        return [self._accept(k, v, per_key_s) for k, v in zip(keys, values, strict=True)]

    def contains(self, key: str) -> bool:
        try:
            return bool(self._run(lambda c: c.exists(self._k(key))))
        except _Unavailable:
            return False
        except _Refused as e:
            self._refused("EXISTS", e)
            return False

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """One pipelined round trip of EXISTS for all keys."""
        if not keys:
            return []

        def probe(c: Any) -> list[Any]:
            p = self._pipeline(c)
            for k in keys:
                p.exists(self._k(k))
            return p.execute()

        try:
            return [bool(n) for n in self._run(probe)]
        except _Unavailable:
            return [False] * len(keys)
        except _Refused as e:
            self._refused("pipelined EXISTS", e)
            return [False] * len(keys)

    def delete(self, key: str) -> bool:
        try:
            return bool(self._run(lambda c: c.delete(self._k(key))))
        except _Unavailable:
            return False
        except _Refused as e:
            self._refused("DEL", e)
            return False

    def ttl_s(self, key: str) -> float | None:
        """Remaining lifetime of an entry in seconds (None: absent, no expiry, or server unreachable)."""
        try:
            ms = self._run(lambda c: c.pttl(self._k(key)))
        except (_Unavailable, _Refused):
            return None
        return ms / 1000 if ms >= 0 else None

    def clear(self) -> None:
        """Delete every key under this store's prefix (SCAN, so other prefixes are untouched)."""

        def wipe(c: Any) -> None:
            batch: list[str] = []
            for k in c.scan_iter(match=_glob_escape(self.prefix) + "*", count=1000):
                batch.append(k)
                if len(batch) >= 500:
                    self._delete_batch(c, batch)
                    batch = []
            self._delete_batch(c, batch)

        try:
            self._run(wipe)
        except (_Unavailable, _Refused) as e:
            store_log.warning(f"redis {self.name} {self.url} clear", "store %s: clear failed: %r", self.name, e)

    def _delete_batch(self, client: Any, keys: list[Any]) -> None:
        if keys:
            p = self._pipeline(client)
            for k in keys:
                p.delete(k)
            p.execute()

    def close(self) -> None:
        self._closed = True
        self._drop_client(everything=True)

    @property
    def enabled(self) -> bool:
        return not self._closed

    @property
    def degraded(self) -> bool:
        return self._degraded

    def stats(self) -> StoreStats:
        """Counters of this process; entries/bytes are None (the server holds other instances' keys too)."""
        return self._counters.snapshot(
            name=self.name,
            kind=self.kind,
            enabled=self.enabled,
            degraded=self._degraded,
            entries=None,
            nbytes=None,
            capacity_bytes=None,
        )
