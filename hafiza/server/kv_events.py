"""The ZMQ side of KV events: publishes the engine's `KVEventSource` stream as vLLM does, for a router.

Each batch goes out on a PUB socket as `[topic, 8-byte big-endian sequence number, msgpack([ts, [events], 0])]`.
A replay ROUTER socket (optional) answers `[b"", start_seq]` with every kept batch from `start_seq` on, as
`[b"", topic, seq, payload]` frames, then `[b"", topic, -1, b""]`: a subscriber that missed batches (it joined
late, or its queue overflowed) catches up there. One thread owns both sockets; the engine thread only queues.
"""

from __future__ import annotations

import collections
import queue
import threading
import time

import msgpack
import zmq

from hafiza.cache.events import EVENT_BLOCK_SIZE, KVEvent, KVEventSource
from hafiza.engine.engine import LLMEngine
from hafiza.errors import HafizaError

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    """Batches queued events and publishes them; keeps the last `keep` batches for replay."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "", keep: int = 10_000,
                 max_batch: int = 512) -> None:
        self.topic, self.max_batch = topic.encode(), max_batch
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.replay: zmq.Socket | None = None
        try:
            self.pub.bind(endpoint)
            self.endpoint: str = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if replay_endpoint is not None:
                self.replay = self.ctx.socket(zmq.ROUTER)
                self.replay.setsockopt(zmq.LINGER, 0)
                self.replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            which = replay_endpoint if self.replay is not None else endpoint
            raise HafizaError(f"cannot publish KV events on {which}: {e} (give tcp://HOST:PORT on a free port)") \
                from e
        self.replay_endpoint = self.replay.getsockopt_string(zmq.LAST_ENDPOINT) if self.replay is not None else None
        self.queue: queue.Queue[KVEvent | None] = queue.Queue()
        self.kept: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=keep)
        self.seq = 0
        self.thread = threading.Thread(target=self._run, name="hafiza-kv-events", daemon=True)
        self.thread.start()

    def put(self, event: KVEvent) -> None:
        """Queue one event (any thread; the publisher thread sends it with the others queued by then)."""
        self.queue.put(event)

    def wait_sent(self) -> None:
        """Block until every event queued so far has been published."""
        self.queue.join()

    def close(self) -> None:
        """Send what is queued, then stop and close the sockets."""
        self.queue.put(None)
        self.thread.join(10)

    def _run(self) -> None:
        running = True
        while running:
            item: KVEvent | _Nothing | None
            try:
                item = self.queue.get(timeout=0.05)
            except queue.Empty:
                item = _NOTHING
            batch: list[KVEvent] = []
            while True:
                if item is None:
                    running = False
                    break
                if not isinstance(item, _Nothing):
                    batch.append(item)
                if len(batch) >= self.max_batch:
                    break
                try:
                    item = self.queue.get_nowait()
                except queue.Empty:
                    break
            if batch:
                self._publish(batch)
            for _ in range(len(batch) + (item is None)):
                self.queue.task_done()
            self._answer_replays()
        self._close_sockets()

    def _publish(self, batch: list[KVEvent]) -> None:
        payload = msgpack.packb([time.time(), [e.wire() for e in batch], 0])
        seq = self.seq
        self.seq += 1
        self.kept.append((seq, payload))
        self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))

    def _answer_replays(self) -> None:
        while self.replay is not None and self.replay.poll(0):
            frames = self.replay.recv_multipart()
            if len(frames) < 3 or len(frames[-1]) != 8:
                continue
            client, start = frames[0], int.from_bytes(frames[-1], "big")
            for seq, payload in list(self.kept):
                if seq >= start:
                    self.replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
            self.replay.send_multipart((client, b"", self.topic, END_SEQ, b""))

    def _close_sockets(self) -> None:
        self.pub.close()
        if self.replay is not None:
            self.replay.close()
        self.ctx.term()


class _Nothing:
    """A queue timeout: no event, but the replay socket is still looked at."""


_NOTHING = _Nothing()


def publish_kv_events(engine: LLMEngine, endpoint: str, replay_endpoint: str | None = None) -> KVEventPublisher:
    """Attach a `KVEventSource` to the engine's block manager that publishes on `endpoint` (before the engine
    thread starts). The first batch is AllBlocksCleared: a restarted worker holds nothing it announced before."""
    block_size = engine.blocks.block_size
    if block_size % EVENT_BLOCK_SIZE:
        raise HafizaError(f"--kv-events announces blocks of {EVENT_BLOCK_SIZE} tokens, as vLLM does: the block "
                          f"size {block_size} must be a multiple of {EVENT_BLOCK_SIZE}")
    publisher = KVEventPublisher(endpoint, replay_endpoint)
    source = KVEventSource(block_size, publisher.put)
    source.cleared()
    engine.blocks.events = source
    return publisher
