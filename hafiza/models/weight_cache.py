"""Repacked GGUF weights kept on disk after a file's first load and memory-mapped on later loads.

Repacking a 1.5B model costs seconds of CPU (the compiled kernels, numba's start, zeroing the new memory); a later
load of the same file in the same format maps the kernel-layout arrays straight from the cache, as llama.cpp
maps its own file. One directory per (GGUF size, mtime, sha256 of its first and last MiB, torch version, weights
mode, device type, the running ISA's int4 block rows, layout version); one file per repacked matmul, written to a
temporary name and renamed, so a reader never sees half a file. Only the CPU layout is cached.

Directory: `settings.WEIGHTS_CACHE` (a path, or `off` to disable), else `$XDG_CACHE_HOME/hafiza/weights`, else
`~/.cache/hafiza/weights`. The `KEEP` most recently used models are kept, older ones removed.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from hafiza import settings
from hafiza.models.linear import int4_block_rows

LAYOUT_VERSION = "1"  # bump when a cached array's layout or values change
KEEP = 8  # models x layouts: three GGUFs under both ISAs (bench weights --isa native,avx2) must not evict each other
log = logging.getLogger(__name__)


def cache_root() -> Path | None:
    """Where the cache lives, or None when settings.WEIGHTS_CACHE is `off`."""
    env = settings.WEIGHTS_CACHE.read()
    if env.lower() in ("off", "0", "no", "false"):
        return None
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hafiza" / "weights"


def model_key(path: Path, mode: str, device: torch.device) -> str:
    """The cache directory's name for one GGUF file loaded with `mode` on `device`."""
    st = path.stat()
    layout = int4_block_rows() if device.type == "cpu" else None  # the int4 layout follows the ISA torch runs
    h = hashlib.sha256(f"{LAYOUT_VERSION}|{torch.__version__}|{mode}|{device.type}|{layout}|{st.st_size}|"
                       f"{st.st_mtime_ns}".encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, st.st_size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:24]


class WeightCache:
    """The cached arrays of one model: `read` maps an entry (None if absent or of the wrong size), `write` stores
    one in the background (the arrays are the model's own, never copied)."""

    def __init__(self, root: Path, key: str) -> None:
        self.dir = root / key
        self.root = root
        self._writer: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @staticmethod
    def entry(names: list[str], fmt: str) -> str:
        return hashlib.sha256(("|".join(names) + "|" + fmt).encode()).hexdigest()[:32]

    def read(self, entry: str, nbytes: int) -> np.ndarray | None:
        """The entry's bytes as a private writable map of the file (pages shared with the page cache until
        written, which nothing does), or None."""
        file = self.dir / entry
        try:
            with file.open("rb") as f:
                if os.fstat(f.fileno()).st_size != nbytes:
                    self.misses += 1
                    return None
                pages = mmap.mmap(f.fileno(), nbytes, flags=mmap.MAP_PRIVATE,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            self.misses += 1
            return None
        self.hits += 1
        return np.frombuffer(pages, dtype=np.uint8)

    def write(self, entry: str, parts: list[np.ndarray]) -> None:
        """Store `parts` (C-contiguous arrays) back to back as the entry, in a background thread."""
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="hafiza-weight-cache")
        self._pending.append(self._writer.submit(self._write, entry, parts))

    def _write(self, entry: str, parts: list[np.ndarray]) -> None:
        tmp = self.dir / f".{entry}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            with tmp.open("wb") as f:
                for p in parts:
                    f.write(memoryview(np.ascontiguousarray(p)).cast("B"))
            os.replace(tmp, self.dir / entry)
        except OSError as exc:
            log.warning("weight cache: could not store %s in %s (%s); loads stay uncached", entry, self.dir, exc)
            tmp.unlink(missing_ok=True)

    def flush(self) -> None:
        """Wait for the background writes (tests, and before evicting)."""
        for f in self._pending:
            f.result()
        self._pending.clear()

    def touch_and_evict(self) -> None:
        """Mark this model as used now and remove all but the KEEP most recently used models."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            others = [d.stat().st_mtime_ns for d in self.root.iterdir() if d.is_dir() and d != self.dir]
            now = time.time_ns()  # later than every other entry: the kernel's coarse clock gives near uses one mtime
            os.utime(self.dir, ns=(now, max(now, max(others, default=0) + 1)))
            dirs = sorted((d for d in self.root.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime_ns,
                          reverse=True)
        except OSError:
            return
        for old in dirs[KEEP:]:
            shutil.rmtree(old, ignore_errors=True)


def open_cache(path: Path, mode: str, device: torch.device) -> WeightCache | None:
    """The cache for this file, mode and device, or None (disabled, or not the CPU layout)."""
    root = cache_root()
    if root is None or device.type != "cpu":
        return None
    try:
        cache = WeightCache(root, model_key(path, mode, device))
    except OSError:
        return None
    cache.touch_and_evict()
    return cache
