"""Local-disk tier: one file per entry in 256 sharded subdirectories, byte-capped LRU, survives restarts.

Each file is `<root>/<xx>/<digest>.kv` where digest = blake2b-128 of the key and xx its first two hex digits;
its content is the integrity frame (frame.py). Writes go to a `.tmp-*` file in the same shard and are
renamed over the final name (`os.replace`), so a reader sees an old or a new file, never a partial one.
The LRU index lives in memory and is rebuilt on start from the files' modification times (puts and hits
set them from a strictly increasing clock, so recency survives restarts); leftover `.tmp-*` files from a
crash are removed then. A lock file keeps a second process off the same directory. Any write error (full
disk, read-only directory) disables the tier with one log line; puts return False until a retry after
`retry_after_s` succeeds.

The directory may be deleted under a running store: at most every `check_interval_s` (and at once when a
write finds it gone) the store checks that its lock file is still the one it locked. If not, it forgets its
entries, recreates the directory, locks the new lock file (so a second process still cannot take it over)
and keeps serving. Besides its byte cap, the tier keeps the filesystem's real free space
(`shutil.disk_usage`) above a small reserve, evicting its own least recent entries to make room; a write
that still finds the disk full evicts and retries once before the tier disables itself.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import logging
import os
import re
import shutil
import threading
import time
from collections import OrderedDict
from pathlib import Path

from hafiza.store.base import KVStore
from hafiza.store.frame import FrameError, frame_header, unpack
from hafiza.store.logs import store_log
from hafiza.store.stats import StoreCounters, StoreStats

log = logging.getLogger("hafiza.store")

_SHARD_RE = re.compile(r"[0-9a-f]{2}")
_FILE_RE = re.compile(r"([0-9a-f]{32})\.kv")
TMP_PREFIX = ".tmp-"
LOCK_NAME = ".lock"
RESERVE_FRACTION = 0.10  # free space the tier leaves to everyone else: 10 % of the filesystem, at most 1 GiB
MAX_RESERVE_BYTES = 1 << 30
FILE_SLACK_BYTES = 4096  # a file occupies whole filesystem blocks


def key_digest(key: str) -> str:
    """The 32-hex-digit file stem of a key (fixed length, file-name safe)."""
    return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


class DiskStore(KVStore):
    """A directory of framed files with an in-memory LRU index; see the module docstring."""

    kind = "disk"

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        name: str = "disk",
        fsync: bool = False,
        retry_after_s: float = 30.0,
        check_interval_s: float = 1.0,
    ):
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes={capacity_bytes} must be >= 0")
        self.name = name
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.retry_after_s = retry_after_s
        self.check_interval_s = check_interval_s
        self.reserve_bytes = 0
        self._index: OrderedDict[str, int] = OrderedDict()  # digest -> file size, least recent first
        self._bytes = 0
        self._lock = threading.Lock()
        self._counters = StoreCounters()
        self._tmp_ids = itertools.count()
        self._lock_fd: int | None = None
        self._lock_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the lock file we hold
        self._root_lock = threading.Lock()  # one thread at a time checks and recreates the directory
        self._next_check = 0.0
        self._shards: set[str] = set()
        self._enabled = True
        self._disabled_at = 0.0
        self._closed = False
        self._last_stamp = 0
        self.removed_temp_files = 0
        self._open()

    # -- opening and disabling ---------------------------------------------------------------------------

    def _open(self) -> bool:
        """Create the directory, take its lock and rebuild the index; on failure disable the tier."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                self._disable(f"{self.root} is in use by another store (lock held)")
                return False
            except OSError:
                os.close(fd)
                raise
            st = os.fstat(fd)
            self._lock_fd, self._lock_id = fd, (st.st_dev, st.st_ino)
            self.reserve_bytes = min(MAX_RESERVE_BYTES, int(shutil.disk_usage(self.root).total * RESERVE_FRACTION))
            self._rebuild()
        except OSError as e:
            self._disable(f"cannot open {self.root}: {e}")
            return False
        return True

    def _rebuild(self) -> None:
        """Index every `<xx>/<digest>.kv` by modification time; remove leftover temp files."""
        found: list[tuple[int, str, int]] = []
        for shard in os.scandir(self.root):
            if not (_SHARD_RE.fullmatch(shard.name) and shard.is_dir(follow_symlinks=False)):
                continue
            self._shards.add(shard.name)
            for entry in os.scandir(shard.path):
                if entry.name.startswith(TMP_PREFIX):
                    try:
                        os.unlink(entry.path)
                        self.removed_temp_files += 1
                    except FileNotFoundError:
                        pass
                elif (m := _FILE_RE.fullmatch(entry.name)) and m.group(1).startswith(shard.name):
                    st = entry.stat(follow_symlinks=False)
                    found.append((st.st_mtime_ns, m.group(1), st.st_size))
        found.sort()
        with self._lock:
            self._index = OrderedDict((digest, size) for _, digest, size in found)
            self._bytes = sum(size for _, _, size in found)
            self._evict_locked(keep=None)
        log.info(
            "store %s: %s holds %d entries (%d bytes); removed %d temp files",
            self.name, self.root, len(self._index), self._bytes, self.removed_temp_files,
        )  # fmt: skip

    def _root_intact(self) -> bool:
        """Whether `<root>/.lock` is still the file this store locked (not deleted, not replaced)."""
        try:
            st = os.stat(self.root / LOCK_NAME)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._lock_id

    def _check_root(self, force: bool = False) -> bool:
        """Recreate the directory if it vanished (at most every `check_interval_s` unless `force`).

        True when the directory had to be recreated and now is usable again.
        """
        now = time.monotonic()
        if self._closed or self._lock_fd is None or (not force and now < self._next_check):
            return False
        with self._root_lock:
            self._next_check = now + self.check_interval_s
            if self._closed or self._lock_fd is None or self._root_intact():
                return False
            with self._lock:
                lost, lost_bytes = len(self._index), self._bytes
                self._index.clear()
                self._bytes = 0
                self._shards.clear()
                fd, self._lock_fd, self._lock_id = self._lock_fd, None, None
            os.close(fd)
            store_log.warning(
                f"disk {self.root} vanished",
                "store tier %s (disk): %s was deleted or replaced; recreating it (%d entries, %d bytes forgotten)",
                self.name, self.root, lost, lost_bytes,
            )  # fmt: skip
            return self._open()

    def _space_needed(self, size: int) -> int:
        """Bytes to free so that writing `size` bytes leaves the filesystem's reserve free (0: it fits)."""
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            return 0  # the write itself will tell what is wrong
        return max(0, size + FILE_SLACK_BYTES + self.reserve_bytes - free)

    def _make_room(self, size: int, keep: str | None) -> int | None:
        """Evict least recent entries until `size` bytes fit in the free space; None when they cannot."""
        need = self._space_needed(size)
        if need == 0:
            return 0
        n = 0
        with self._lock:
            while need > 0 and self._index:
                digest, entry = next(iter(self._index.items()))
                if digest == keep:
                    if len(self._index) == 1:
                        break
                    self._index.move_to_end(digest)
                    continue
                del self._index[digest]
                self._bytes -= entry
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.root / digest[:2] / f"{digest}.kv")
                need -= entry + FILE_SLACK_BYTES
                n += 1
        if n:
            self._counters.evict(n)
        return n if self._space_needed(size) == 0 else None

    def _disable(self, reason: str) -> None:
        """Switch the tier off with one clear log line (repeated failures stay quiet)."""
        with self._lock:
            was_enabled, self._enabled = self._enabled, False
            self._disabled_at = time.monotonic()
        if was_enabled:
            store_log.error(
                f"disk {self.root} disabled",
                "store tier %s (disk) disabled: %s; serving continues without it", self.name, reason,
            )  # fmt: skip

    def _may_write(self) -> bool:
        """Enabled, or disabled long enough ago that one write may probe whether the disk recovered."""
        if self._closed:
            return False
        if self._enabled:
            return True
        if time.monotonic() - self._disabled_at < self.retry_after_s:
            return False
        self._disabled_at = time.monotonic()
        return self._lock_fd is not None or self._open()

    def _stamp(self, path: Path) -> None:
        """Set the file's mtime to a strictly increasing clock, so LRU order survives a restart exactly."""
        with self._lock:
            self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
            ns = self._last_stamp
        with contextlib.suppress(OSError):
            os.utime(path, ns=(ns, ns))

    # -- paths -------------------------------------------------------------------------------------------

    def path_of(self, key: str) -> Path:
        """Where the entry for `key` lives (whether or not it exists)."""
        digest = key_digest(key)
        return self.root / digest[:2] / f"{digest}.kv"

    # -- KVStore -----------------------------------------------------------------------------------------

    def put(self, key: str, value: bytes, ttl_s: float | None = None) -> bool:
        """Write a framed temp file, rename it into place, then evict least recent files over the cap.

        Entries are evicted first when the filesystem's free space is short; a vanished directory is
        recreated and the write retried once, as is a write that found the disk full.
        """
        t0 = time.perf_counter()
        self._check_root()
        if not self._may_write():
            self._counters.reject()
            return False
        header = frame_header(key, value)
        size = len(header) + len(value)
        if size > self.capacity_bytes:
            self._counters.reject()
            return False
        digest = key_digest(key)
        if self._make_room(size, keep=digest) is None:
            self._counters.reject()
            store_log.warning(
                f"disk {self.root} no space",
                "store %s: %s has too little free space for a %d-byte entry even with this tier empty; not stored",
                self.name, self.root, size,
            )  # fmt: skip
            return False
        for attempt in (0, 1):
            try:
                evicted = self._write(digest, header, value, size)
                break
            except OSError as e:
                if attempt == 0 and e.errno == errno.ENOENT and self._check_root(force=True):
                    continue
                if attempt == 0 and e.errno in (errno.ENOSPC, errno.EDQUOT) and self._evict_oldest(2 * size):
                    continue
                self._counters.error()
                self._disable(f"cannot write {self.root / digest[:2] / f'{digest}.kv'}: {e}")
                return False
        if not self._enabled:
            with self._lock:
                self._enabled = True
            store_log.warning(
                f"disk {self.root} re-enabled",
                "store tier %s (disk) re-enabled: writes to %s succeed again", self.name, self.root,
            )  # fmt: skip
        if evicted:
            self._counters.evict(evicted)
        self._counters.put(size, time.perf_counter() - t0)
        return True

    def _write(self, digest: str, header: bytes, value: bytes, size: int) -> int:
        """Write one entry's file atomically and index it; how many entries the byte cap evicted."""
        shard = self.root / digest[:2]
        final = shard / f"{digest}.kv"
        tmp = shard / f"{TMP_PREFIX}{digest}-{os.getpid()}-{next(self._tmp_ids)}"
        try:
            if digest[:2] not in self._shards:
                shard.mkdir(exist_ok=True)
                self._shards.add(digest[:2])
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(value)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            self._stamp(tmp)
            with self._lock:
                os.replace(tmp, final)
                old = self._index.pop(digest, None)
                self._bytes += size - (old or 0)
                self._index[digest] = size
                evicted = self._evict_locked(keep=digest)
            if self.fsync:
                dir_fd = os.open(shard, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return evicted

    def _evict_oldest(self, nbytes: int) -> bool:
        """Evict least recent entries worth at least `nbytes` (after ENOSPC); False when there were none."""
        n = freed = 0
        with self._lock:
            while freed < nbytes and self._index:
                digest, size = self._index.popitem(last=False)
                self._bytes -= size
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.root / digest[:2] / f"{digest}.kv")
                freed += size
                n += 1
        if n:
            self._counters.evict(n)
        return n > 0

    def _evict_locked(self, keep: str | None) -> int:
        """Unlink least recent files until the cap holds (never `keep`); caller holds the lock."""
        n = 0
        while self._bytes > self.capacity_bytes and self._index:
            digest, size = next(iter(self._index.items()))
            if digest == keep:
                break
            del self._index[digest]
            self._bytes -= size
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.root / digest[:2] / f"{digest}.kv")
            n += 1
        assert self._bytes >= 0
        return n

    def _forget(self, digest: str, unlink: bool) -> None:
        """Drop an index entry (and its file) that turned out missing or damaged."""
        with self._lock:
            size = self._index.pop(digest, None)
            if size is not None:
                self._bytes -= size
            if unlink:
                with contextlib.suppress(OSError):
                    os.unlink(self.root / digest[:2] / f"{digest}.kv")

    def get(self, key: str) -> bytes | None:
        """Read and verify the file; a damaged one is deleted and reported as an error and a miss."""
        t0 = time.perf_counter()
        self._check_root()
        digest = key_digest(key)
        with self._lock:
            known = digest in self._index
        if not known or self._closed:
            self._counters.miss()
            return None
        path = self.root / digest[:2] / f"{digest}.kv"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self._forget(digest, unlink=False)
            self._counters.miss()
            return None
        except OSError as e:
            store_log.warning(f"disk {self.root} read", "store %s: cannot read %s: %s", self.name, path, e)
            self._counters.error()
            self._counters.miss()
            return None
        try:
            payload = unpack(key, data)
        except FrameError as e:
            store_log.warning(
                f"disk {self.root} damaged", "store %s: dropped damaged entry %s: %s", self.name, path, e
            )
            self._forget(digest, unlink=True)
            self._counters.error()
            self._counters.miss()
            return None
        with self._lock:
            if digest in self._index:
                self._index.move_to_end(digest)
        self._stamp(path)
        self._counters.hit(len(data), time.perf_counter() - t0)
        return payload

    def contains(self, key: str) -> bool:
        """Whether the index lists the key (the file is verified only by `get`)."""
        self._check_root()
        with self._lock:
            return not self._closed and key_digest(key) in self._index

    def delete(self, key: str) -> bool:
        """Remove the entry and its file."""
        digest = key_digest(key)
        with self._lock:
            present = digest in self._index
        if present:
            self._forget(digest, unlink=True)
        return present

    def clear(self) -> None:
        """Remove every entry file of this store."""
        with self._lock:
            for digest in self._index:
                with contextlib.suppress(OSError):
                    os.unlink(self.root / digest[:2] / f"{digest}.kv")
            self._index.clear()
            self._bytes = 0

    def close(self) -> None:
        """Release the directory lock; the files stay for the next start."""
        with self._root_lock, self._lock:
            self._closed = True
            self._index.clear()
            self._bytes = 0
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = self._lock_id = None

    @property
    def enabled(self) -> bool:
        return self._enabled and not self._closed

    def effective_capacity(self) -> int:
        """The byte cap, or less when the filesystem cannot hold it: what we hold plus the free space above
        the reserve."""
        with self._lock:
            held = self._bytes
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            return self.capacity_bytes
        return min(self.capacity_bytes, held + max(0, free - self.reserve_bytes))

    def stats(self) -> StoreStats:
        """Counters, entries and bytes; `capacity_bytes` is the effective capacity (see `effective_capacity`)."""
        with self._lock:
            entries, nbytes = len(self._index), self._bytes
        return self._counters.snapshot(
            name=self.name,
            kind=self.kind,
            enabled=self.enabled,
            degraded=False,
            entries=entries,
            nbytes=nbytes,
            capacity_bytes=self.effective_capacity(),
        )
