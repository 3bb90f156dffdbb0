"""LLMEngine: the Python API the server and users call — submit, step, stream, abort, read stats."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from hafiza.cache.block_manager import BlockManager, BlockStats
from hafiza.cache.memory import kv_memory_bytes
from hafiza.device import dtype_name
from hafiza.engine.connector import KVConnector
from hafiza.engine.output import TextOutput
from hafiza.engine.runner import ModelRunner
from hafiza.engine.sampling import SamplingParams, sample
from hafiza.engine.scheduler import Scheduler, SchedulerConfig
from hafiza.engine.sequence import CachePin, Sequence, Status
from hafiza.errors import RequestError
from hafiza.models.loader import LoadedModel
from hafiza.quant.eviction import AttentionScores, make_policy
from hafiza.quant.factory import (
    FULL_KINDS,
    blocks_that_fit,
    bytes_per_token,
    fixed_bytes,
    layout_for,
    make_kv_cache,
    with_blocks,
)


def resolve_kv_kind(name: str, model_dtype: torch.dtype) -> str:
    """'auto' -> bf16, 'model' -> the compute dtype's name; anything else must be a known pool kind."""
    if name == "auto":
        return "bf16"
    if name == "model":
        return dtype_name(model_dtype)
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(name, name)


@dataclass
class EngineConfig:
    """Engine knobs. kv_dtype: auto (bf16), model (the compute dtype), fp32, bf16, fp16, fp8, int8 or int4.
    eviction (streaming | h2o) with kv_budget_tokens caps the KV one sequence keeps (contexts beyond memory)."""

    kv_memory: str | int | float = "auto"
    kv_dtype: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    cache_salt: str | None = None
    eviction: str | None = None
    kv_budget_tokens: int | None = None
    sink_tokens: int = 4


@dataclass
class RequestOutput:
    """What one step produced for one request; `text` is the new text since the last output."""

    request_id: str
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    stop_sequence: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    pinned_tokens: int = 0
    external_tokens: int = 0
    external_sources: dict[str, int] = field(default_factory=dict)
    external_decision: str = ""
    arrival_time: float = 0.0
    first_token_time: float | None = None


@dataclass
class GenerationResult:
    """A finished request, for the synchronous `generate` API."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclass
class EngineStats:
    """Memory accounting and counters, read by the server's /metrics and the dashboard."""

    blocks: BlockStats
    bytes_per_block: int
    kv_dtype: str
    num_running: int
    num_waiting: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    requests_finished: int
    stored_tokens: int
    waste_slots: int
    extra: dict = field(default_factory=dict)

    @property
    def kv_cache_usage_perc(self) -> float:
        return self.blocks.usage_perc


class LLMEngine:
    """One model, one paged KV pool, one scheduler. Not thread-safe: drive it from one thread (see AsyncEngine)."""

    def __init__(self, model: LoadedModel, config: EngineConfig | None = None) -> None:
        self.loaded, self.config = model, config or EngineConfig()
        cfg, c = self.config, model.config
        self.tokenizer = model.tokenizer
        self.kv_kind = resolve_kv_kind(cfg.kv_dtype, model.dtype)
        self.max_model_len = min(cfg.max_model_len or c.max_position_embeddings, c.max_position_embeddings)
        probe = layout_for(c, 1, cfg.block_size, model.dtype)
        budget = kv_memory_bytes(cfg.kv_memory, model.device)
        num_blocks = blocks_that_fit(budget, self.kv_kind, probe, max_seqs=cfg.max_num_seqs)
        self.bytes_per_block = int(bytes_per_token(self.kv_kind, probe) * cfg.block_size)
        if num_blocks < 1:
            staging = fixed_bytes(self.kv_kind, probe, max_seqs=cfg.max_num_seqs)
            extra = f" after {self.kv_kind}'s full-precision window of {staging} bytes" if staging else ""
            raise RequestError(f"--kv-memory {cfg.kv_memory} ({budget} bytes) holds no KV block of "
                               f"{self.bytes_per_block} bytes{extra}; raise --kv-memory or lower --max-num-seqs")
        self.layout = with_blocks(probe, num_blocks)
        self.kv = make_kv_cache(self.kv_kind, self.layout, model.device, max_seqs=cfg.max_num_seqs)
        self.blocks = BlockManager(num_blocks, cfg.block_size)
        self.eviction = make_policy(cfg.eviction, cfg.sink_tokens) if cfg.eviction else None
        if self.eviction is not None and not cfg.kv_budget_tokens:
            raise RequestError("--eviction needs --kv-budget-tokens (the most KV tokens one sequence may keep)")
        budget_blocks = cfg.kv_budget_tokens // cfg.block_size if cfg.kv_budget_tokens else None
        needs_scores = self.eviction is not None and self.eviction.needs_scores
        self.scores = AttentionScores(num_blocks, model.device) if needs_scores else None
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.enable_prefix_caching), self.blocks,
            eviction=self.eviction, budget_blocks=budget_blocks, scores=self.scores,
        )
        exact = self.kv_kind in FULL_KINDS and FULL_KINDS[self.kv_kind] == model.dtype
        self.runner = ModelRunner(model.model, self.kv, cfg.block_size, fresh_kv_exact=exact, scores=self.scores)
        self.extra_keys = (model.fingerprint, self.kv_kind, cfg.block_size)
        self.seqs: dict[str, Sequence] = {}
        self.outputs: dict[str, TextOutput] = {}
        self._ids = itertools.count()
        self.prompt_tokens = self.generation_tokens = self.requests_finished = 0
        self.connector: KVConnector | None = None

    def attach_connector(self, connector: KVConnector) -> None:
        """Connect KV tiers below the pool: full blocks are written through, admissions look them up."""
        self.connector = connector
        self.scheduler.connector = connector

    @property
    def capacity_tokens(self) -> int:
        return self.layout.num_blocks * self.layout.block_size

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def check_request(self, prompt_ids: Seq[int], params: SamplingParams) -> None:
        """Reject at once what can never be served, stating the numbers (safe to call from any thread)."""
        params.validate()
        n = len(prompt_ids)
        if n == 0:
            raise RequestError("the prompt is empty")
        vocab = self.loaded.config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise RequestError(f"prompt contains token ids outside the vocabulary [0, {vocab})")
        if n + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt of {n} tokens + max_tokens {params.max_tokens} = {n + params.max_tokens} exceeds the "
                f"model's context of {self.max_model_len} tokens"
            )
        if n + params.max_tokens > self.capacity_tokens:
            raise RequestError(
                f"prompt of {n} tokens + max_tokens {params.max_tokens} needs "
                f"{-(-(n + params.max_tokens) // self.layout.block_size)} KV blocks but the pool has "
                f"{self.layout.num_blocks} ({self.capacity_tokens} tokens); raise --kv-memory"
            )

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None,
                    pins: Seq[CachePin] = ()) -> str:
        """Queue a request; returns its id. Raises RequestError if it can never be served."""
        params = params or SamplingParams()
        ids = self.encode_prompt(prompt)
        self.check_request(ids, params)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.seqs:
            raise RequestError(f"request id {rid!r} is already in use")
        salt = cache_salt if cache_salt is not None else self.config.cache_salt
        gen = None
        if not params.greedy and params.seed is not None:
            gen = torch.Generator().manual_seed(params.seed)
        seq = Sequence(rid, list(ids), len(ids), params, extra_keys=(*self.extra_keys, salt),
                       pins=tuple(pins), generator=gen)
        self.seqs[rid] = seq
        self.outputs[rid] = TextOutput(self.tokenizer, params.stop)
        self.scheduler.add(seq)
        return rid

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; returns False if it was not (or no longer) running."""
        seq = self.seqs.pop(request_id, None)
        self.outputs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        seq.finish_reason = "abort"
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample, and report every request that produced output or finished."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        t0 = time.perf_counter()
        logits, last = self.runner.execute(batch)
        sampling = [s for s, i in zip(batch.seqs, last, strict=True) if i >= 0]
        tokens: list[int] = []
        if logits is not None:
            tokens = sample(logits, [s.params for s in sampling], [s.generator for s in sampling])
        if self.connector is not None:
            self._observe_prefill(batch.num_new, time.perf_counter() - t0)
        for seq, n in zip(batch.seqs, batch.num_new, strict=True):
            seq.num_computed += n
            self._cache_full_blocks(seq)
        outputs = []
        now = time.monotonic()
        sampled = dict(zip((s.request_id for s in sampling), tokens, strict=True))
        for seq in batch.seqs:
            out = self._advance(seq, sampled.get(seq.request_id), now)
            if out is not None:
                outputs.append(out)
        return outputs

    def _observe_prefill(self, num_new: list[int], seconds: float) -> None:
        """Tell the KV tiers' cost model how fast prefill runs here (recompute is the alternative to a load)."""
        tokens = sum(n for n in num_new if n > 1)
        if tokens and self.connector is not None:
            self.connector.observe_prefill(tokens, seconds)

    def _cache_full_blocks(self, seq: Sequence) -> None:
        bs = self.layout.block_size
        full = seq.num_computed // bs
        if seq.evicted:
            seq.num_cached_blocks = full  # K/V computed without the evicted tokens: never offered as a prefix
            return
        if full > seq.num_cached_blocks:
            hashes = seq.hashes(bs)
            for b in range(seq.num_cached_blocks, full):
                self.blocks.cache_block(seq.block_table[b], hashes[b], seq.token_ids[b * bs : (b + 1) * bs])
                if self.connector is not None:
                    self.connector.save(hashes[b], seq.block_table[b])
            seq.num_cached_blocks = full
        for pin in seq.pins:
            covered = min(pin.num_tokens, seq.num_prompt_tokens) // bs
            if covered and full >= covered and seq.pinned_tokens < covered * bs:
                self.blocks.pin(seq.hashes(bs)[:covered], pin.ttl_s)
        if seq.pins:
            covered = max(min(p.num_tokens, seq.num_prompt_tokens) // bs for p in seq.pins)
            if full >= covered:
                seq.pinned_tokens = covered * bs

    def _advance(self, seq: Sequence, token: int | None, now: float) -> RequestOutput | None:
        """Append the sampled token, apply stop conditions, finish and free the sequence when done."""
        p, text_out = seq.params, self.outputs[seq.request_id]
        new: list[int] = []
        text = ""
        if seq.num_computed == seq.num_tokens and p.max_tokens == 0:
            seq.finish_reason = "length"
        elif token is not None:
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.token_ids.append(token)
            new = [token]
            self.generation_tokens += 1
            if not p.ignore_eos and (token in self.tokenizer.eos_token_ids or token in p.stop_token_ids):
                seq.finish_reason = "stop"
            else:
                text = text_out.add(token)
                if text_out.stop_sequence is not None:
                    seq.finish_reason, seq.stop_sequence = "stop_sequence", text_out.stop_sequence
                elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                    seq.finish_reason = "length"
        else:
            return None
        finished = seq.finish_reason is not None
        if finished:
            text += text_out.flush() if seq.stop_sequence is None else ""
            self.scheduler.remove(seq)
            self.seqs.pop(seq.request_id, None)
            self.outputs.pop(seq.request_id, None)
            self.prompt_tokens += seq.num_prompt_tokens
            self.requests_finished += 1
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=new, text=text, finished=finished,
            finish_reason=seq.finish_reason, stop_sequence=seq.stop_sequence,
            num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens or 0,
            num_output_tokens=seq.num_output_tokens, pinned_tokens=seq.pinned_tokens,
            external_tokens=seq.external_tokens, external_sources=dict(seq.external_sources),
            external_decision=seq.external_decision,
            arrival_time=seq.arrival_time, first_token_time=seq.first_token_time,
        )

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[GenerationResult]:
        """Run prompts to completion (continuous batching across them); results in prompt order."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        acc: dict[str, tuple[list[int], list[str]]] = {i: ([], []) for i in ids}
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                toks, texts = acc[out.request_id]
                toks += out.new_token_ids
                texts.append(out.text)
                if out.finished:
                    done[out.request_id] = out
        return [
            GenerationResult(i, "".join(acc[i][1]), acc[i][0], done[i].finish_reason, done[i].num_prompt_tokens,
                             done[i].num_cached_tokens)
            for i in ids
        ]

    def stats(self) -> EngineStats:
        """A snapshot of memory use and counters."""
        bstats = self.blocks.stats()
        bs = self.layout.block_size
        fill: dict[int, int] = {}
        for seq in self.scheduler.running:
            for b, bid in enumerate(seq.block_table):
                fill[bid] = max(fill.get(bid, 0), min(bs, max(0, seq.num_computed - b * bs)))
        stored = sum(fill.values())
        return EngineStats(
            blocks=bstats, bytes_per_block=self.bytes_per_block, kv_dtype=self.kv_kind,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions, prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens, requests_finished=self.requests_finished,
            stored_tokens=stored, waste_slots=bstats.in_use * bs - stored,
        )

    def check_integrity(self) -> None:
        """Block invariants plus: every block referenced by a live sequence has a matching reference."""
        self.blocks.check_integrity()
        refs: dict[int, int] = {}
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            for bid in seq.block_table:
                refs[bid] = refs.get(bid, 0) + 1
            if seq.status is Status.WAITING:
                assert not seq.block_table, f"waiting request {seq.request_id} holds blocks"
        for b in self.blocks.blocks:
            assert refs.get(b.block_id, 0) == b.ref_count, (
                f"block {b.block_id}: ref_count {b.ref_count} but {refs.get(b.block_id, 0)} sequence references")
