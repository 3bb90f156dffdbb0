"""KV events over real ZMQ: a SUB socket (with the replay socket for what it missed) rebuilds exactly the set of
blocks the block manager holds, after random requests, evictions and clears; salted prompts never appear."""

from __future__ import annotations

from collections.abc import Iterator

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from hafiza.cache.block_manager import BlockManager
from hafiza.cache.events import KVEventSource, event_hash
from hafiza.cache.hashing import chain_hashes
from hafiza.engine import EngineConfig, LLMEngine, SamplingParams
from hafiza.errors import HafizaError
from hafiza.models import LoadedModel
from hafiza.server.kv_events import KVEventPublisher, publish_kv_events
from tests.support.examples import examples

POLL_MS = 5_000


class Subscriber:
    """What a router does: apply live batches in order, fetch a gap from the replay socket."""

    def __init__(self, ctx: zmq.Context, publisher: KVEventPublisher) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(publisher.endpoint)
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(publisher.replay_endpoint or "")
        self.last = -1
        self.stored: set[int] = set()
        self.tokens: list[int] = []

    def apply(self, payload: bytes) -> None:
        ts, events, rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and rank == 0
        for e in events:
            assert isinstance(e, dict), "events are tagged maps"
            if e["type"] == "BlockStored":
                assert e["block_size"] == 16 and e["medium"] == "GPU"
                assert len(e["token_ids"]) == 16 * len(e["block_hashes"])
                self.stored.update(e["block_hashes"])
                self.tokens.extend(e["token_ids"])
            elif e["type"] == "BlockRemoved":
                self.stored.difference_update(e["block_hashes"])
            else:
                assert e["type"] == "AllBlocksCleared"
                self.stored.clear()

    def replay(self) -> None:
        self.dealer.send_multipart([b"", (self.last + 1).to_bytes(8, "big")])
        while True:
            assert self.dealer.poll(POLL_MS), "the replay socket did not answer"
            _, _topic, seq_bytes, payload = self.dealer.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == -1:
                return
            if seq == self.last + 1:
                self.apply(payload)
                self.last = seq

    def catch_up(self, last_seq: int) -> None:
        """Read until batch `last_seq` is applied."""
        while self.last < last_seq:
            if not self.sub.poll(200):
                self.replay()  # nothing live (the subscription may still be joining): ask for what was missed
                continue
            _topic, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.last + 1:
                self.replay()
            if seq == self.last + 1:
                self.apply(payload)
                self.last = seq

    def close(self) -> None:
        self.sub.close()
        self.dealer.close()


@pytest.fixture
def zmq_ctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def expected(bm: BlockManager) -> set[int]:
    """The event hashes of every shared-partition block the pool holds."""
    source = bm.events
    assert isinstance(source, KVEventSource)
    return {h for ph in bm.hash_to_block if ph in source.announced for h in source.hashes_of(ph)}


OPS = st.lists(st.one_of(
    st.tuples(st.just("request"), st.integers(0, 2), st.integers(0, 40), st.booleans()),
    st.tuples(st.just("drop_all"), st.just(0), st.just(0), st.just(False)),
), min_size=1, max_size=12)


@settings(max_examples=examples(0.25))
@given(ops=OPS, pool_block=st.sampled_from([16, 32]))
def test_the_event_stream_rebuilds_the_block_managers_cached_set(ops: list[tuple[str, int, int, bool]],
                                                                 pool_block: int) -> None:
    ctx = zmq.Context()
    publisher = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    sub = Subscriber(ctx, publisher)
    try:
        source = KVEventSource(pool_block, publisher.put)
        bm = BlockManager(6, pool_block, events=source)
        source.cleared()
        prefixes = [[p * 1000 + i for i in range(3 * pool_block)] for p in range(3)]
        salted: set[int] = set()
        for op, prefix, suffix, salt in ops:
            if op == "drop_all":
                bm.drop(list(bm.hash_to_block))
                continue
            tokens = [*prefixes[prefix][: pool_block + suffix * 2], *range(5000, 5000 + suffix)]
            part = "tenant" if salt else None
            hashes = chain_hashes(tokens, pool_block, (part,))
            match = bm.match_prefix(tokens, hashes)
            need = -(-len(tokens) // pool_block) - match.num_blocks
            alloc = bm.admit(match, need, len(tokens))
            if alloc is None:
                continue
            bm.cache_chain(alloc.block_ids, hashes, tokens, match.num_blocks, len(hashes), part)
            if salt:
                salted.update(event_hash(h, i) for h in hashes for i in range(pool_block // 16))
            bm.free(alloc.block_ids)
            bm.check_integrity()
        publisher.wait_sent()
        sub.catch_up(publisher.seq - 1)
        assert sub.stored == expected(bm)
        assert not sub.stored & salted
        assert {h for ph in bm.hash_to_block for h in source.hashes_of(ph)} - sub.stored <= salted
    finally:
        sub.close()
        publisher.close()
        ctx.term()


def test_an_engine_announces_shared_prompts_and_not_salted_ones(tiny_llama: LoadedModel,
                                                              zmq_ctx: zmq.Context) -> None:
    engine = LLMEngine(tiny_llama, EngineConfig(kv_memory=2**22, max_num_seqs=4))
    publisher = publish_kv_events(engine, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    sub = Subscriber(zmq_ctx, publisher)
    try:
        shared = list(range(100, 150))
        secret = list(range(300, 350))
        engine.generate([shared], SamplingParams(max_tokens=2))
        engine.add_request(secret, SamplingParams(max_tokens=2), cache_salt="tenant-a")
        while engine.has_unfinished():
            engine.step()
        publisher.wait_sent()
        sub.catch_up(publisher.seq - 1)
        assert sub.tokens[:48] == shared[:48]
        assert not set(secret) & set(sub.tokens)
        assert sub.stored == expected(engine.blocks) and len(sub.stored) == 3
    finally:
        sub.close()
        publisher.close()


def test_a_block_size_the_router_cannot_index_is_a_clear_error(tiny_llama: LoadedModel) -> None:
    engine = LLMEngine(tiny_llama, EngineConfig(kv_memory=2**22, max_num_seqs=4, block_size=8))
    with pytest.raises(HafizaError, match="multiple of 16"):
        publish_kv_events(engine, "tcp://127.0.0.1:*")


def test_a_taken_port_is_a_clear_error(zmq_ctx: zmq.Context) -> None:
    publisher = KVEventPublisher("tcp://127.0.0.1:*")
    try:
        with pytest.raises(HafizaError, match="cannot publish KV events on tcp"):
            KVEventPublisher(publisher.endpoint)
    finally:
        publisher.close()
