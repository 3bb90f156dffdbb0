"""Starting the server: load the model, build the engine (its thread is started once everything is attached),
run uvicorn (in the foreground or a thread)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from dataclasses import dataclass

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from hafiza.engine.async_engine import AsyncEngine
from hafiza.engine.engine import EngineConfig, LLMEngine
from hafiza.models.loader import LoadedModel, load_model

log = logging.getLogger("hafiza.server")


def served_name(lm: LoadedModel) -> str:
    """The model id clients send: the GGUF file's stem or the model directory's name."""
    return lm.path.stem if lm.path.is_file() else lm.path.name


def build_engine(model: str | None, device: str, dtype: str, config: EngineConfig, max_waiting: int | None = None,
                 max_queue_time_s: float | None = None, weights: str = "auto") -> AsyncEngine:
    """Load the model (weights in the `weights` format) and build the engine with its overload limits. Its thread
    is not started: attach the store and build the app first, then `start()` it (only the engine thread touches
    the engine once it runs). The grammar compiler's tokenizer info is built here, before any request."""
    lm = load_model(model, dtype=dtype, device=device, weights=weights)
    engine = LLMEngine(lm, config)
    engine.grammars.prepare()
    return AsyncEngine(engine, max_waiting=max_waiting, max_queue_time_s=max_queue_time_s)


def describe(aengine: AsyncEngine) -> str:
    """One line on what is being served, for the start-up log."""
    e = aengine.engine
    return (f"{e.loaded.name} on {e.loaded.device} ({e.loaded.dtype}); KV pool {e.layout.num_blocks} blocks x "
            f"{e.layout.block_size} tokens = {e.capacity_tokens} tokens ({e.bytes_per_block} B per block, "
            f"{e.kv_dtype}); context {e.max_model_len}")


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol plus a deadline on request headers: a connection whose headers have not all
    arrived `header_timeout_s` seconds after it opened (or after its first byte of a next request) is closed,
    so slow-header clients (slowloris) cannot hold connections open. The body has its own deadline (read_body)."""

    header_timeout_s: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # the first bytes of a next request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.info("closing a connection whose request headers took over %g s", self.header_timeout_s)
            self.transport.close()


def uvicorn_config(app: FastAPI, host: str, port: int, log_level: str, header_timeout_s: float = 10.0,
                   **kwargs: object) -> uvicorn.Config:
    """uvicorn's configuration for `app`: the h11 protocol with the header deadline."""
    protocol = type("HeaderDeadline", (HeaderDeadlineProtocol,), {"header_timeout_s": header_timeout_s})
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol, **kwargs)  # type: ignore[arg-type]


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
        settings = getattr(self.app.state, "hafiza", None)
        header_timeout = settings.settings.header_timeout_s if settings is not None else 10.0
        config = uvicorn_config(self.app, self.host, self.port, self.log_level, header_timeout,
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
