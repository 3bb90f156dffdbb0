"""CPU work of a request (JSON parsing, validation, template rendering, tokenization) on worker threads, so the
event loop keeps answering other connections (`/health`, streams) while a large body is turned into a prompt."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

WORKERS = max(2, min(8, os.cpu_count() or 2))
_POOL = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="hafiza-prompt")


async def off_loop(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`fn(*args, **kwargs)` on a worker thread; its exception (an ApiError, say) is raised here."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_POOL, functools.partial(fn, *args, **kwargs))
