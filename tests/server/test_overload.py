"""Overload and slow clients: a bounded queue and a queue-time limit answer 429 (OpenAI) / 529 (Anthropic) with
retry-after, queue time is in /metrics, request size limits state their numbers, slow headers and bodies are cut
off, and the event loop keeps answering while a 3.5 MB body of 100,000 messages is turned into a prompt.

The engine is held between steps (inside `AsyncEngine.call`) so that which request waits is decided by the test,
not by timing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import anthropic
import httpx
import openai
import pytest

from hafiza.engine import EngineConfig, LLMEngine
from hafiza.engine.async_engine import AsyncEngine
from hafiza.models import LoadedModel
from hafiza.server import ServerSettings, create_app
from hafiza.server.launch import ServerThread, served_name
from tests.server.conftest import Server
from tests.server.test_metrics import value

QUEUE_LIMIT_S = 0.5
MSG = [{"role": "user", "content": "hi"}]


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@dataclass
class Queued:
    """A server whose engine runs one request at a time, lets one wait, and drops any waiting over 0.5 s."""

    url: str
    model: str
    aengine: AsyncEngine


@pytest.fixture(scope="module")
def queued(default_model: LoadedModel) -> Iterator[Queued]:
    config = EngineConfig(kv_memory="64MiB", kv_dtype="model", max_num_seqs=1)
    aengine = AsyncEngine(LLMEngine(default_model, config), max_waiting=1, max_queue_time_s=QUEUE_LIMIT_S).start()
    name = served_name(default_model)
    thread = ServerThread(create_app(aengine, ServerSettings(model_name=name))).start()
    yield Queued(thread.url, name, aengine)
    thread.stop()
    aengine.shutdown()


class Hold:
    """Keeps the engine thread inside a call (between steps) until `release()`, or until `until(engine)`."""

    def __init__(self, aengine: AsyncEngine, until: Callable[[LLMEngine], bool] | None = None) -> None:
        self.entered, self._release = threading.Event(), threading.Event()

        def hold(engine: LLMEngine) -> None:
            self.entered.set()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not self._release.is_set():
                if until is not None and until(engine):
                    return
                time.sleep(0.005)

        self.thread = threading.Thread(target=lambda: asyncio.run(aengine.call(hold)))
        self.thread.start()

    def release(self) -> None:
        self._release.set()
        self.thread.join(60)


class Call(threading.Thread):
    """A client call on its own thread; `result` is what it returned or raised."""

    def __init__(self, fn: Callable[[], object]) -> None:
        super().__init__()
        self.fn, self.result = fn, None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except Exception as exc:
            self.result = exc


def clients(q: Queued) -> tuple[anthropic.Anthropic, openai.OpenAI]:
    return (anthropic.Anthropic(base_url=q.url, api_key="unused", max_retries=0, timeout=120),
            openai.OpenAI(base_url=f"{q.url}/v1", api_key="unused", max_retries=0, timeout=120))


def ask_anthropic(client: anthropic.Anthropic, model: str) -> Callable[[], object]:
    return lambda: client.messages.with_raw_response.create(model=model, max_tokens=1, messages=MSG)


def ask_openai(client: openai.OpenAI, model: str) -> Callable[[], object]:
    return lambda: client.chat.completions.with_raw_response.create(model=model, max_tokens=1, messages=MSG)


@pytest.mark.parametrize("api", ["anthropic", "openai"])
def test_a_full_queue_answers_at_once_with_retry_after(queued: Queued, api: str) -> None:
    a, o = clients(queued)
    first = ask_anthropic(a, queued.model) if api == "openai" else ask_openai(o, queued.model)
    second = ask_openai(o, queued.model) if api == "openai" else ask_anthropic(a, queued.model)
    hold = Hold(queued.aengine)
    wait_for(hold.entered.is_set, "the engine to be held")
    waiting = Call(first)
    wait_for(lambda: queued.aengine.pending_commands >= 1, "the first request to reach the engine")
    refused = Call(second)
    wait_for(lambda: queued.aengine.pending_commands >= 2, "the second request to reach the engine")
    hold.release()
    waiting.join(120)
    refused.join(120)
    assert not isinstance(waiting.result, Exception), waiting.result
    err = refused.result
    if api == "openai":
        assert isinstance(err, openai.RateLimitError), err
        assert err.status_code == 429 and err.body["type"] == "rate_limit_error" and err.body["code"] == "overloaded"
    else:
        assert isinstance(err, anthropic.OverloadedError), err
        assert err.status_code == 529 and err.body["error"]["type"] == "overloaded_error"
    assert int(err.response.headers["retry-after"]) >= 1
    assert "1 requests already wait for admission, the limit is 1" in err.message


@pytest.mark.parametrize("api", ["anthropic", "openai"])
def test_a_request_waiting_past_the_queue_time_limit_is_refused(queued: Queued, api: str) -> None:
    a, o = clients(queued)
    ask = ask_anthropic(a, queued.model) if api == "anthropic" else ask_openai(o, queued.model)
    before = httpx.get(f"{queued.url}/metrics", timeout=120).text
    hold = Hold(queued.aengine)
    wait_for(hold.entered.is_set, "the engine to be held")
    late = Call(ask)
    wait_for(lambda: queued.aengine.pending_commands >= 1, "the request to reach the engine")

    def aged(engine: LLMEngine) -> bool:
        waiting = list(engine.scheduler.waiting)
        return bool(waiting) and all(time.monotonic() - s.arrival_time > QUEUE_LIMIT_S for s in waiting)

    keep = Hold(queued.aengine, until=aged)  # runs right after the request is queued, until it has waited too long
    wait_for(lambda: queued.aengine.pending_commands >= 2, "the second hold to be queued")
    hold.release()
    late.join(120)
    keep.release()
    err = late.result
    assert isinstance(err, anthropic.OverloadedError if api == "anthropic" else openai.RateLimitError), err
    assert err.status_code == (529 if api == "anthropic" else 429)
    assert err.response.headers["retry-after"] == "1"
    assert "without being scheduled, the limit is 0.5 s" in err.message
    after = httpx.get(f"{queued.url}/metrics", timeout=120).text
    status = "529" if api == "anthropic" else "429"
    assert value(after, "request_errors_total", api=api, status=status) == value(
        before, "request_errors_total", api=api, status=status) + 1
    assert queued.aengine.engine.stats().num_waiting == 0


def test_queue_time_is_a_histogram(queued: Queued) -> None:
    before = httpx.get(f"{queued.url}/metrics", timeout=120).text
    _, o = clients(queued)
    o.chat.completions.create(model=queued.model, max_tokens=1, messages=MSG)
    after = httpx.get(f"{queued.url}/metrics", timeout=120).text
    assert "hafiza:request_queue_time_seconds_bucket" in after
    assert value(after, "request_queue_time_seconds_count") == value(before, "request_queue_time_seconds_count") + 1


# Request size limits and slow clients.

@pytest.fixture(scope="module")
def limited(engine: AsyncEngine, server: Server) -> Iterator[str]:
    settings = ServerSettings(model_name=server.model, max_messages=50, max_prompt_chars=20_000,
                              header_timeout_s=1.0, body_timeout_s=1.0)
    thread = ServerThread(create_app(engine, settings)).start()
    yield thread.url
    thread.stop()


def test_message_count_and_prompt_size_limits(limited: str, server: Server) -> None:
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "x"} for i in range(51)]
    big = [{"role": "user", "content": "y" * 30_000}]
    for path in ("/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions"):
        limit = {} if path.endswith("count_tokens") else {"max_tokens": 1}
        r = httpx.post(f"{limited}{path}", timeout=120, json={"model": server.model, **limit, "messages": many})
        assert r.status_code == 400, r.text
        assert "messages: 51 messages exceed the server's limit of 50" in r.text
        r = httpx.post(f"{limited}{path}", timeout=120, json={"model": server.model, **limit, "messages": big})
        assert r.status_code == 400, r.text
        assert "the messages hold 30000 characters of text; the limit is 20000" in r.text
    r = httpx.post(f"{limited}/v1/messages", timeout=120,
                   json={"model": server.model, "max_tokens": 1, "messages": many[:49]})
    assert r.status_code == 200, r.text


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def test_slow_headers_are_cut_off(limited: str) -> None:
    socks = [socket.create_connection(_address(limited)) for _ in range(20)]
    for s in socks:
        s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    trickle, open_socks = socks[0], set(socks)
    deadline = time.monotonic() + 60
    while open_socks and time.monotonic() < deadline:
        with contextlib.suppress(OSError):  # a header line every 0.2 s never completes the headers
            trickle.sendall(b"X-Slow: 1\r\n")
        readable, _, _ = select.select(list(open_socks), [], [], 0.2)
        for s in readable:
            try:
                data = s.recv(4096)
            except ConnectionResetError:
                data = b""
            if not data:
                open_socks.discard(s)
    for s in socks:
        s.close()
    assert not open_socks, f"{len(open_socks)} slow-header connections still open after 60 s"
    assert httpx.get(f"{limited}/health", timeout=120).status_code == 200


def test_slow_body_gets_408_and_is_closed(limited: str, server: Server) -> None:
    s = socket.create_connection(_address(limited))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
              b"content-length: 1000\r\n\r\n{")
    reply = b""
    start = time.monotonic()
    deadline = start + 60
    while time.monotonic() < deadline:
        readable, _, _ = select.select([s], [], [], 0.2)
        if not readable:
            # one byte every 0.2 s, then silence: never the whole body within the 1 s deadline. Sending stops
            # before the deadline, because a byte reaching the server after it has answered and closed makes its
            # kernel reset the connection, which can discard the 408 before the client reads it.
            if time.monotonic() - start < 0.8:
                s.sendall(b" ")
            continue
        data = s.recv(65536)
        if not data:
            break
        reply += data
    s.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply
    assert b"connection: close" in head.lower()
    assert "request body not received within 1 s" in json.loads(body)["error"]["message"]


# The event loop stays free while a huge body is parsed, validated, rendered and tokenized on a worker thread.

@pytest.fixture(scope="module")
def roomy(engine: AsyncEngine, server: Server) -> Iterator[str]:
    settings = ServerSettings(model_name=server.model, max_messages=200_000, max_body_bytes=8 * 2**20,
                              max_prompt_chars=10_000_000)
    thread = ServerThread(create_app(engine, settings)).start()
    yield thread.url
    thread.stop()


def test_health_answers_while_a_huge_body_is_processed(roomy: str, server: Server) -> None:
    messages = [{"role": "user", "content": f"message number {i} of many"} for i in range(100_000)]
    body = json.dumps({"model": server.model, "max_tokens": 1, "messages": messages}).encode()
    assert len(body) > 3_500_000
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
               b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
    sent, answered = threading.Event(), threading.Event()
    reply: list[bytes] = []

    def big() -> None:
        with socket.create_connection(_address(roomy)) as s:
            s.sendall(request)
            sent.set()
            while chunk := s.recv(65536):
                reply.append(chunk)
        answered.set()

    thread = threading.Thread(target=big)
    thread.start()
    wait_for(sent.is_set, "the body to be sent")
    health_answers = 0
    with httpx.Client(base_url=roomy, timeout=120) as client:
        while not answered.is_set():
            r = client.get("/health")
            assert r.status_code == 200
            if not answered.is_set():
                health_answers += 1
    thread.join(120)
    text = b"".join(reply)
    assert text.startswith(b"HTTP/1.1 400"), text[:300]
    assert b"exceeds the model's context" in text or b"characters; the limit is" in text, text[-300:]
    assert health_answers >= 5, f"/health answered {health_answers} times while the body was processed"
