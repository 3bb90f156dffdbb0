"""Starting the server: load the model, start the engine thread, run uvicorn (in the foreground or a thread)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from hafiza.engine.async_engine import AsyncEngine
from hafiza.engine.engine import EngineConfig, LLMEngine
from hafiza.models.loader import LoadedModel, load_model

log = logging.getLogger("hafiza.server")


def served_name(lm: LoadedModel) -> str:
    """The model id clients send: the GGUF file's stem or the model directory's name."""
    return lm.path.stem if lm.path.is_file() else lm.path.name


def start_engine(model: str | None, device: str, dtype: str, config: EngineConfig) -> AsyncEngine:
    """Load the model and start the engine thread."""
    lm = load_model(model, dtype=dtype, device=device)
    return AsyncEngine(LLMEngine(lm, config)).start()


def describe(aengine: AsyncEngine) -> str:
    """One line on what is being served, for the start-up log."""
    e = aengine.engine
    return (f"{e.loaded.name} on {e.loaded.device} ({e.loaded.dtype}); KV pool {e.layout.num_blocks} blocks x "
            f"{e.layout.block_size} tokens = {e.capacity_tokens} tokens ({e.layout.bytes_per_block} B per block, "
            f"{e.stats().kv_dtype}); context {e.max_model_len}")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class ServerThread:
    """uvicorn serving `app` on a background thread (tests and benchmarks); `stop()` shuts it down."""

    app: FastAPI
    host: str = "127.0.0.1"
    port: int = 0
    log_level: str = "warning"

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        self.port = self.port or free_port(self.host)
        config = uvicorn.Config(self.app, host=self.host, port=self.port, log_level=self.log_level,
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="hafiza-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
