"""LLMEngine: the Python API the server and users call — submit, step, stream, abort, read stats."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hafiza.cache.block_manager import BlockManager
from hafiza.cache.eviction import AttentionScores, make_policy
from hafiza.cache.kv_cache_manager import KVCacheManager
from hafiza.cache.layout import FULL_DTYPES
from hafiza.cache.memory import kv_memory_bytes
from hafiza.cache.pool import (
    blocks_that_fit,
    bytes_for_tokens,
    bytes_per_block,
    fixed_bytes,
    layout_for,
    make_kv_pool,
    with_blocks,
)
from hafiza.device import dtype_name
from hafiza.engine.checks import RequestLimits, check_request
from hafiza.engine.connector import KVConnector, SavedBlock
from hafiza.engine.determinism import determinism_header, nondeterminism_reasons
from hafiza.engine.output import token_logprobs
from hafiza.engine.output_processor import OutputProcessor
from hafiza.engine.results import EngineStats, FinishReason, GenerationResult, RequestOutput
from hafiza.engine.runner import ModelRunner
from hafiza.engine.sampling import SamplingParams, apply_penalties, mask_early_stops, sample
from hafiza.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from hafiza.engine.sequence import CachePin, Sequence, Status
from hafiza.engine.speculative import DraftBudget, NgramProposer, SpecCounters, SpeculativeConfig
from hafiza.engine.speculative.draft import DraftModelProposer, check_same_vocab
from hafiza.engine.speculative.verify import verify
from hafiza.errors import ConfigError, RequestError
from hafiza.models.loader import LoadedModel

if TYPE_CHECKING:
    from hafiza.engine.grammar import GrammarCompiler

log = logging.getLogger("hafiza.engine")


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a seeded request: the request's own for choice 0, distinct for the others."""
    return seed if index == 0 else (seed + index * 0x9E3779B97F4A7C15) % 2**64


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> str:
    """'auto' -> bf16, 'model' -> the compute dtype's name; anything else must be a known KV storage dtype."""
    if name == "auto":
        return "bf16"
    if name == "model":
        return dtype_name(model_dtype)
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(name, name)


def kv_memory_for_tokens(model: LoadedModel, config: EngineConfig, tokens: int) -> int:
    """Bytes of KV memory that hold `tokens` tokens for this model and config: a pool sized to one request, as
    llama.cpp sizes its context (`hafiza generate`)."""
    probe = layout_for(model.config, 1, config.block_size, resolve_kv_dtype(config.kv_dtype, model.dtype),
                       model.dtype)
    return bytes_for_tokens(probe, tokens, max_seqs=config.max_num_seqs)


@dataclass
class EngineConfig:
    """Engine knobs. kv_dtype: auto (bf16), model (the compute dtype), fp32, bf16, fp16, fp8, int8 or int4.
    eviction (streaming | h2o) with kv_budget_tokens caps the KV one sequence keeps (contexts beyond memory).
    speculative: draft tokens ahead and verify them in the same batched step (None: plain decoding); its draft
    method runs `draft_model`, loaded by the caller from the config's speculative_model."""

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
    speculative: SpeculativeConfig | None = None
    draft_model: LoadedModel | None = None


class LLMEngine:
    """One model, one paged KV pool, one scheduler. Not thread-safe: drive it from one thread (see AsyncEngine)."""

    def __init__(self, model: LoadedModel, config: EngineConfig | None = None) -> None:
        self.loaded, self.config = model, config or EngineConfig()
        cfg, c = self.config, model.config
        self.tokenizer = model.tokenizer
        self.max_model_len = min(cfg.max_model_len or c.max_position_embeddings, c.max_position_embeddings)
        probe = layout_for(c, 1, cfg.block_size, resolve_kv_dtype(cfg.kv_dtype, model.dtype), model.dtype)
        budget = kv_memory_bytes(cfg.kv_memory, model.device)
        num_blocks = blocks_that_fit(budget, probe, max_seqs=cfg.max_num_seqs)
        if num_blocks < 1:
            staging = fixed_bytes(probe, max_seqs=cfg.max_num_seqs)
            extra = f" after {probe.kv_dtype}'s full-precision window of {staging} bytes" if staging else ""
            raise ConfigError(f"KV memory {cfg.kv_memory} ({budget} bytes) holds no KV block of "
                              f"{bytes_per_block(probe)} bytes{extra}; give the pool more memory"
                              f"{' or allow fewer sequences' if staging else ''}", setting="kv_memory")
        self.layout = with_blocks(probe, num_blocks)
        self.kv = make_kv_pool(self.layout, model.device, max_seqs=cfg.max_num_seqs)
        self.blocks = BlockManager(num_blocks, cfg.block_size)
        self.eviction = make_policy(cfg.eviction, cfg.sink_tokens) if cfg.eviction else None
        if self.eviction is not None and not cfg.kv_budget_tokens:
            raise ConfigError(f"{cfg.eviction} eviction needs a KV token budget (the most KV tokens one sequence "
                              f"may keep)", setting="kv_budget_tokens")
        budget_blocks = cfg.kv_budget_tokens // cfg.block_size if cfg.kv_budget_tokens else None
        needs_scores = self.eviction is not None and self.eviction.needs_scores
        self.scores = AttentionScores(num_blocks, model.device) if needs_scores else None
        self.cache = KVCacheManager(self.blocks, self.eviction, budget_blocks, self.scores)
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.enable_prefix_caching), self.cache)
        exact = FULL_DTYPES.get(self.kv_dtype) == model.dtype
        self.runner = ModelRunner(model.model, self.kv, cfg.block_size, fresh_kv_exact=exact, scores=self.scores)
        self.extra_keys = (model.fingerprint, self.kv_dtype, cfg.block_size)
        self.limits = RequestLimits(c.vocab_size, self.max_model_len, num_blocks, cfg.block_size)
        self.seqs: dict[str, Sequence] = {}
        self.output = OutputProcessor(self.tokenizer, self.max_model_len)
        self._grammars: GrammarCompiler | None = None
        self._ids = itertools.count()
        self.connector: KVConnector | None = None
        self.nondeterminism = nondeterminism_reasons(self.kv_dtype, cfg.eviction, model.device, model.dtype)
        self.determinism = determinism_header(self.nondeterminism)  # the x-hafiza-deterministic header
        self.spec = SpecCounters()
        self.proposer: NgramProposer | None = None
        self.drafter: DraftModelProposer | None = None
        if cfg.speculative is not None:
            cfg.speculative.validate()
            if self.eviction is not None:
                raise ConfigError("speculative decoding does not combine with eviction (verified rows would land in "
                                  "blocks the policy may drop)", setting="speculative_method")
            if cfg.speculative.method == "draft":
                self.drafter = self._drafter(cfg.draft_model)
            else:
                self.proposer = NgramProposer(*cfg.speculative.lookup_range)
            self.scheduler.propose = self._propose

    def _drafter(self, draft: LoadedModel | None) -> DraftModelProposer:
        """The draft method's proposer, once the draft model is known to share the target's vocabulary."""
        if draft is None:
            raise ConfigError("speculative method draft needs the loaded speculative_model (EngineConfig.draft_model)",
                              setting="speculative_model")
        check_same_vocab(self.loaded, draft)
        kv_dtype = self.kv_dtype if self.kv_dtype in FULL_DTYPES else "bf16"  # drafts overwrite mid-block
        return DraftModelProposer(draft, block_size=self.config.block_size, kv_dtype=kv_dtype,
                                  tokens=self.blocks.num_blocks * self.config.block_size)

    def attach_connector(self, connector: KVConnector) -> None:
        """Connect KV tiers below the pool: full blocks are written through, admissions look them up."""
        self.connector = connector
        self.scheduler.connector = connector

    @property
    def kv_dtype(self) -> str:
        """How the pool stores K/V (the configured kv_dtype with 'auto'/'model' resolved)."""
        return self.layout.kv_dtype

    @property
    def bytes_per_block(self) -> int:
        """Stored bytes of one KV block, as the pool's format counts them."""
        return self.kv.bytes_per_block

    @property
    def capacity_tokens(self) -> int:
        return self.layout.num_blocks * self.layout.block_size

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler for this model's tokenizer (xgrammar is imported on first use)."""
        if self._grammars is None:
            from hafiza.engine.grammar import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer, self.loaded.config.vocab_size)
        return self._grammars

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def check_request(self, prompt_ids: Seq[int], params: SamplingParams) -> None:
        """Reject at once what can never be served, stating the numbers (safe to call from any thread)."""
        check_request(prompt_ids, params, self.limits, lambda spec: self.grammars.compile(spec))

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None,
                    pins: Seq[CachePin] = ()) -> str:
        """Queue a request; returns its id. Raises RequestError if it can never be served."""
        params = params or SamplingParams()
        ids = self.encode_prompt(prompt)
        self.check_request(ids, params)
        return self.add_checked(ids, params, request_id, cache_salt, pins)

    def add_checked(self, prompt_ids: Seq[int], params: SamplingParams, request_id: str | None = None,
                    cache_salt: str | None = None, pins: Seq[CachePin] = ()) -> str:
        """Queue a request `check_request` has already accepted (AsyncEngine checks on the caller's thread, so
        the engine thread does not decide it again); raises RequestError only for an id already in use."""
        ids = list(prompt_ids)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.seqs or rid in self.output.groups:
            raise RequestError(f"request id {rid!r} is already in use")
        salt = cache_salt if cache_salt is not None else self.config.cache_salt
        if params.n > 1:
            self.output.open_group(rid, params.n, salt)
        self._add_choice(rid, ids, params, salt, tuple(pins), 0)
        return rid

    def _add_choice(self, rid: str, ids: list[int], params: SamplingParams, salt: str | None,
                    pins: tuple[CachePin, ...], index: int) -> None:
        """Queue choice `index` of request `rid`: choice 0 is sequence `rid`, choice i > 0 is `rid/i`. Choice
        i > 0 draws from its own seed, derived from the request's, so choices differ and each is reproducible."""
        sid = rid if index == 0 else f"{rid}/{index}"
        gen = None
        if not params.greedy and params.seed is not None:
            gen = torch.Generator().manual_seed(choice_seed(params.seed, index))
        grammar = self.grammars.state(params.grammar) if params.grammar is not None else None
        spec = self.config.speculative
        budget = DraftBudget(spec.num_speculative_tokens) if spec is not None and params.speculative else None
        seq = Sequence(sid, ids, len(ids), params, extra_keys=(*self.extra_keys, salt), pins=pins, generator=gen,
                       parent_id=rid if params.n > 1 else None, index=index, grammar=grammar, draft_budget=budget)
        self.seqs[sid] = seq
        self.output.add(seq)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Stop a request (all its choices) and free its blocks; returns False if it was not (or no longer)
        running."""
        group = self.output.drop(request_id)
        found = False
        for sid in [request_id, *(f"{request_id}/{i}" for i in range(1, group.n if group else 1))]:
            seq = self.seqs.pop(sid, None)
            if seq is not None:
                self.scheduler.remove(seq)
                seq.finish_reason = FinishReason.ABORT
                if self.drafter is not None:
                    self.drafter.release(sid)
                found = True
        return found

    def request(self, request_id: str) -> Sequence | None:
        """The live sequence of a request id (choice 0), None once it finished or was aborted."""
        return self.seqs.get(request_id)

    def request_ids(self) -> list[str]:
        """The ids of every live sequence (a request's choices 1..n-1 as `id/i`)."""
        return list(self.seqs)

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission."""
        return len(self.scheduler.waiting)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample, and report every request that produced output or finished.
        A request whose forward or sampling raises finishes with `error`; its batch-mates go on unchanged."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            if self.connector is not None:
                self.connector.serving(False)
            return []
        if self.connector is not None:
            self.connector.serving(True)
        t0 = time.perf_counter()
        rows, failed = self._forward(batch)
        sampling = [s for s in batch.seqs if s.request_id in rows]
        sampled: dict[str, int] = {}
        if sampling:
            sampled = self._sample(torch.cat([rows[s.request_id][:1] for s in sampling]), sampling, failed)
        if self.connector is not None:
            self._observe_prefill(batch.num_new, time.perf_counter() - t0)
        outputs = []
        now = time.monotonic()
        for seq, n in zip(batch.seqs, batch.num_new, strict=True):
            if seq.request_id in failed:
                outputs.append(self._finish(seq, self.output.fail(seq, failed[seq.request_id])))
                continue
            draft, seq.draft = seq.draft, []
            seq.num_computed += n - len(draft)
            self._cache_full_blocks(seq)
            token = sampled.get(seq.request_id)
            if draft and token is not None:
                out = self._verify(seq, draft, rows[seq.request_id], token, now)
            else:
                out = self._advance(seq, token, now)
            if out is not None:
                outputs.append(out)
        if self.connector is not None and not self.has_unfinished():
            self.connector.serving(False)
        return outputs

    def _propose(self, seq: Sequence, room: int) -> list[int]:
        """The scheduler's hook: tokens to draft past a decoding sequence, at most `room`, its draft budget and
        what its max_tokens and the context leave after this step's own token."""
        if seq.draft_budget is None or seq.needs_prompt_logits:
            return []
        limit = min(room, seq.params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1)
        if limit <= 0:
            return []
        limit = min(limit, seq.draft_budget.allowed())
        if self.drafter is not None:
            hashes = seq.hashes(self.config.block_size) if self.config.enable_prefix_caching else ()
            draft = self.drafter.propose(seq.token_ids, limit, seq.request_id, hashes)
        else:
            assert self.proposer is not None, "the propose hook is installed only with a proposer"
            draft = self.proposer.propose(seq.token_ids, limit)
        # what follows a stop token is never kept: the request ends there, or the target rejects the stop itself
        end = next((i + 1 for i, t in enumerate(draft) if seq.params.ends_on(t, self.tokenizer.eos_token_ids)), None)
        return draft[:end]

    def _verify(self, seq: Sequence, draft: list[int], rows: torch.Tensor, first: int, now: float,
                ) -> RequestOutput | None:
        """Emit the drafted run's tokens plain decoding would produce (`verify`), then roll back: num_computed
        counts only rows whose input was accepted, and blocks past it (written only for rejected rows) are freed.
        A partly rejected block is kept; its stale slots are overwritten before it fills and is registered."""
        outs: list[RequestOutput] = []

        def sample(j: int) -> int | None:
            if j == 0:
                return first
            seq.num_computed += 1  # row j's input, draft j - 1, was accepted: its K/V are the sequence's own
            self._cache_full_blocks(seq)
            return self._sample(rows[j : j + 1], [seq], {}).get(seq.request_id)

        def emit(token: int) -> bool:
            out = self._advance(seq, token, now)
            if out is not None:
                outs.append(out)
            return out is not None and not out.finished

        accepted = verify(draft, sample, emit)
        self.spec.record(len(draft), accepted)
        if seq.draft_budget is not None:
            seq.draft_budget.record(len(draft), accepted)
        if seq.status is Status.RUNNING:
            self.cache.truncate(seq.request_id, seq.num_computed)
        return self.output.merge(outs)

    def _forward(self, batch: ScheduledBatch) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Logits [1 + drafted, V] of every sequence that samples this step (its last known token's row, then
        one per drafted token), and the errors of those whose forward failed.
        If the batch's forward raises, each sequence runs alone (attention and linears are row-invariant, so
        its values do not change) and only those that fail again are failed."""
        try:
            return self._rows(batch, *self._execute(batch)), {}
        except Exception as exc:
            if len(batch.seqs) == 1:
                log.exception("forward of request %s failed", batch.seqs[0].request_id)
                return {}, {batch.seqs[0].request_id: f"forward failed: {exc}"}
        rows: dict[str, torch.Tensor] = {}
        failed: dict[str, str] = {}
        for i, seq in enumerate(batch.seqs):
            alone = batch.alone(i)
            try:
                rows |= self._rows(alone, *self._execute(alone))
            except Exception as exc:
                log.exception("forward of request %s failed", seq.request_id)
                failed[seq.request_id] = f"forward failed: {exc}"
        return rows, failed

    @staticmethod
    def _rows(batch: ScheduledBatch, logits: torch.Tensor | None, last: list[int]) -> dict[str, torch.Tensor]:
        """Split the runner's logits per sampling sequence: 1 + len(draft) rows each, in batch order."""
        if logits is None:
            return {}
        out: dict[str, torch.Tensor] = {}
        at = 0
        for seq, i in zip(batch.seqs, last, strict=True):
            if i >= 0:
                count = 1 + len(seq.draft)
                out[seq.request_id] = logits[at : at + count]
                at += count
        return out

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], failed: dict[str, str]) -> dict[str, int]:
        """One token per sequence. If sampling the batch raises, the seeded generators are rewound and each row
        is sampled alone, so a request whose sampling fails is added to `failed` and the others draw as before."""
        states = [s.generator.get_state() if s.generator is not None else None for s in seqs]
        try:
            return dict(zip((s.request_id for s in seqs), self._sample_rows(logits, seqs), strict=True))
        except Exception as exc:
            log.info("batch sampling failed (%s): sampling each of %d rows alone", exc, len(seqs))
        for seq, state in zip(seqs, states, strict=True):
            if seq.generator is not None and state is not None:
                seq.generator.set_state(state)
        out: dict[str, int] = {}
        for i, seq in enumerate(seqs):
            try:
                out[seq.request_id] = self._sample_rows(logits[i : i + 1], [seq])[0]
            except Exception as exc:
                log.exception("sampling for request %s failed", seq.request_id)
                failed[seq.request_id] = f"sampling failed: {exc}"
        return out

    def _sample_rows(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """Penalties and bias, stop tokens masked before min_tokens, then each grammar's mask, then sampling; the
        sampled tokens' logprobs come from the raw `logits` (the model's own distribution)."""
        params = [s.params for s in seqs]
        processed = apply_penalties(logits, params, [s.token_ids for s in seqs], [s.num_prompt_tokens for s in seqs])
        processed = mask_early_stops(processed, params, [s.num_output_tokens for s in seqs],
                                     self.tokenizer.eos_token_ids)
        for i, seq in enumerate(seqs):
            if seq.grammar is not None:
                if processed is logits:
                    processed = logits.clone()
                seq.grammar.mask_(processed[i])
        tokens = sample(processed, params, [s.generator for s in seqs])
        for i, seq in enumerate(seqs):
            k = seq.params.logprobs
            seq.pending_logprob = None if k is None else token_logprobs(logits[i : i + 1], [tokens[i]], k)[0]
        return tokens

    def _execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor | None, list[int]]:
        """The runner's forward; sequences that want prompt logprobs also get every position's logits, recorded
        here."""
        wants = [s.needs_prompt_logits for s in batch.seqs]
        if not any(wants):
            return self.runner.execute(batch)
        logits, last, spans = self.runner.execute_all(batch, wants)
        for seq, n, span in zip(batch.seqs, batch.num_new, spans, strict=True):
            if span is not None:
                self.output.record_prompt_logprobs(seq, n, span)
        return logits, last

    def _finish(self, seq: Sequence, out: RequestOutput) -> RequestOutput:
        """Free a sequence the output processor reported finished (blocks, scheduler entry)."""
        if out.finished:
            self.scheduler.remove(seq)
            self.seqs.pop(seq.request_id, None)
            if self.drafter is not None:
                self.drafter.release(seq.request_id)
        return out

    def _observe_prefill(self, num_new: list[int], seconds: float) -> None:
        """Tell the KV tiers' cost model how fast prefill runs here (recompute is the alternative to a load)."""
        tokens = sum(n for n in num_new if n > 1)
        if tokens and self.connector is not None:
            self.connector.observe_prefill(tokens, seconds)

    def _cache_full_blocks(self, seq: Sequence) -> None:
        bs = self.layout.block_size
        full = seq.num_computed // bs
        if self.cache.evicted(seq.request_id):
            self.cache.register_full(seq.request_id, [], seq.token_ids, full, seq.partition)
            return
        start = self.cache.num_registered(seq.request_id)
        if full > start:
            saved = self.cache.register_full(seq.request_id, seq.hashes(bs), seq.token_ids, full, seq.partition)
            if self.connector is not None:
                for b, (block_hash, block_id) in enumerate(saved, start):
                    ttls = [p.ttl_s for p in seq.pins if b < min(p.num_tokens, seq.num_prompt_tokens) // bs]
                    self.connector.save(SavedBlock(block_hash, block_id, seq.token_ids, (b + 1) * bs,
                                                   max(ttls, default=None)))
        for pin in seq.pins:
            covered = min(pin.num_tokens, seq.num_prompt_tokens) // bs
            if covered and full >= covered and seq.pinned_tokens < covered * bs:
                self.cache.pin(seq.hashes(bs)[:covered], pin.ttl_s)
        if seq.pins:
            covered = max(min(p.num_tokens, seq.num_prompt_tokens) // bs for p in seq.pins)
            if full >= covered:
                seq.pinned_tokens = covered * bs

    def _advance(self, seq: Sequence, token: int | None, now: float) -> RequestOutput | None:
        """The output processor's report of the sampled token; choices 1..n-1 are added once choice 0 has its
        prompt's K/V, and a finished sequence is freed."""
        out = self.output.advance(seq, token, now)
        if out is None:
            return None
        group = self.output.spawn_due(seq) if out.error is None else None
        if group is not None:
            prompt = seq.token_ids[: seq.num_prompt_tokens]
            for i in range(1, group.n):
                self._add_choice(seq.group_id, list(prompt), seq.params, group.cache_salt, seq.pins, i)
        return self._finish(seq, out)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[GenerationResult]:
        """Run prompts to completion (continuous batching across them); results in prompt order, a prompt's n
        choices in index order."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        rids = [(self.add_request(p, sp), sp.n) for p, sp in zip(prompts, plist, strict=True)]
        keys = [(rid, i) for rid, n in rids for i in range(n)]
        acc: dict[tuple[str, int], GenerationResult] = {
            k: GenerationResult(k[0], "", [], None, 0, 0, index=k[1]) for k in keys}
        done = 0
        while done < len(keys):
            for out in self.step():
                done += acc[(out.request_id, out.index)].add(out)
        return [acc[k] for k in keys]

    def stats(self) -> EngineStats:
        """A snapshot of memory use and counters."""
        bstats = self.blocks.stats()
        bs = self.layout.block_size
        fill: dict[int, int] = {}
        for seq in self.scheduler.running:
            for b, bid in enumerate(self.cache.blocks(seq.request_id).block_ids):
                fill[bid] = max(fill.get(bid, 0), min(bs, max(0, seq.num_computed - b * bs)))
        stored = sum(fill.values())
        return EngineStats(
            blocks=bstats, bytes_per_block=self.bytes_per_block, kv_dtype=self.kv_dtype,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions, prompt_tokens=self.output.prompt_tokens,
            generation_tokens=self.output.generation_tokens, requests_finished=self.output.requests_finished,
            stored_tokens=stored, waste_slots=bstats.in_use * bs - stored,
            evicted_tokens=self.cache.evicted_tokens,
            spec=self.spec.snapshot() if self.config.speculative is not None else None,
        )

    def check_integrity(self) -> None:
        """The cache manager's invariants over the live requests, plus: a waiting request holds no block and a
        running one was admitted."""
        live = [*self.scheduler.running, *self.scheduler.waiting]
        for seq in live:
            if seq.status is Status.WAITING:
                assert not self.cache.holds(seq.request_id), f"waiting request {seq.request_id} holds blocks"
            else:
                assert seq.tiers is not None, f"running request {seq.request_id} has no admission outcome"
        self.cache.check_integrity({s.request_id: s.num_computed for s in live},
                                   {s.request_id: s.block_hashes for s in live})
        if self.drafter is not None:
            self.drafter.check_integrity()
            stale = set(self.drafter.states) - {s.request_id for s in live}
            assert not stale, f"finished requests {sorted(stale)} still hold draft blocks"
