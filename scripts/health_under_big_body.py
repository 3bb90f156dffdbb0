"""How long /health waits while a 100,000-message chat body is turned into a prompt: one server per setting, the
body sent on a raw socket, /health polled until the body's answer arrives.

    .venv/bin/python scripts/health_under_big_body.py            # default limits
    .venv/bin/python scripts/health_under_big_body.py --raised   # limits raised so the whole body is processed
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import statistics
import threading
import time

import httpx

from hafiza.engine import EngineConfig, LLMEngine
from hafiza.engine.async_engine import AsyncEngine
from hafiza.models import load_model
from hafiza.server import ServerSettings, create_app
from hafiza.server.launch import ServerThread, served_name


def measure(aengine: AsyncEngine, settings: ServerSettings, request: bytes) -> str:
    """Send `request`, poll /health until its answer is in, and describe what happened."""
    thread = ServerThread(create_app(aengine, settings)).start()
    done, reply, took = threading.Event(), [], []

    def big() -> None:
        with socket.create_connection((thread.host, thread.port)) as s:
            s.sendall(request)
            start = time.monotonic()
            while chunk := s.recv(65536):
                reply.append(chunk)
            took.append(time.monotonic() - start)
        done.set()

    sender = threading.Thread(target=big)
    sender.start()
    waits: list[float] = []
    with httpx.Client(base_url=thread.url, timeout=600) as client:
        while not done.is_set():
            start = time.monotonic()
            client.get("/health")
            waits.append(time.monotonic() - start)
    sender.join()
    thread.stop()
    status = b"".join(reply)[:12].decode()
    return (f"{status}; processed in {took[0]:.2f} s; /health answered {len(waits)} times, slowest "
            f"{max(waits) * 1e3:.0f} ms, median {statistics.median(waits) * 1e3:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--raised", action="store_true", help="raise the message and prompt-size limits")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    model = load_model(device="cpu")
    aengine = AsyncEngine(LLMEngine(model, EngineConfig(kv_memory="64MiB"))).start()
    name = served_name(model)
    messages = [{"role": "user", "content": f"message number {i} of many"} for i in range(100_000)]
    body = json.dumps({"model": name, "max_tokens": 1, "messages": messages}).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)) + body
    limits = {"max_messages": 200_000, "max_prompt_chars": 10_000_000} if args.raised else {}
    settings = ServerSettings(model_name=name, max_body_bytes=8 * 2**20, **limits)
    print(f"{len(body) / 1e6:.1f} MB body, {'raised' if args.raised else 'default'} limits: "
          f"{measure(aengine, settings, request)}")
    aengine.shutdown()


if __name__ == "__main__":
    main()
