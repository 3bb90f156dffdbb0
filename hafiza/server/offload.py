"""CPU work of a request (JSON parsing, validation, template rendering, tokenization) on worker threads, so the
event loop keeps answering other connections (`/health`, streams) while a large body is turned into a prompt.

The pool is made on the first request that needs it, not when the module is imported."""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

WORKERS = max(2, min(8, os.cpu_count() or 2))
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    """The worker pool, made on first use (one per process: every app shares the same cores)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="hafiza-prompt")
        return _pool


async def off_loop(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`fn(*args, **kwargs)` on a worker thread; its exception (an ApiError, say) is raised here."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_executor(), functools.partial(fn, *args, **kwargs))
