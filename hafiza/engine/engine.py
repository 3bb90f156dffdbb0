"""LLMEngine: the Python API the server and users call — submit, step, stream, abort, read stats."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hafiza.cache.block_manager import BlockManager, BlockStats
from hafiza.cache.eviction import AttentionScores, make_policy
from hafiza.cache.layout import FULL_DTYPES
from hafiza.cache.memory import kv_memory_bytes
from hafiza.cache.pool import blocks_that_fit, bytes_per_block, fixed_bytes, layout_for, make_kv_pool, with_blocks
from hafiza.device import dtype_name
from hafiza.engine.connector import KVConnector, TierOutcome
from hafiza.engine.determinism import determinism_header, nondeterminism_reasons
from hafiza.engine.output import TextOutput, TokenLogprob, token_logprobs
from hafiza.engine.runner import ModelRunner
from hafiza.engine.sampling import SamplingParams, apply_penalties, mask_early_stops, sample
from hafiza.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from hafiza.engine.sequence import CachePin, Sequence, Status
from hafiza.engine.speculative import DraftBudget, NgramProposer, SpecCounters, SpeculativeConfig
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


@dataclass
class EngineConfig:
    """Engine knobs. kv_dtype: auto (bf16), model (the compute dtype), fp32, bf16, fp16, fp8, int8 or int4.
    eviction (streaming | h2o) with kv_budget_tokens caps the KV one sequence keeps (contexts beyond memory).
    speculative: draft tokens ahead and verify them in the same batched step (None: plain decoding)."""

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


@dataclass
class RequestOutput:
    """What one step produced for one request; `text` is the new text since the last output. `error` is set (with
    finish_reason "error") when this request alone failed: its forward or its sampling raised. `index` is the
    choice (0..n-1) of a request with n choices, each finishing on its own; `logprobs` cover `new_token_ids`;
    `prompt_logprobs` (one per prompt token, None for the first) come once, on choice 0's first output. `tiers` is
    how the request's admission found its prompt's K/V (pool, store tiers, computed; the `x-hafiza-tiers`
    header), on every output once it was admitted."""

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
    tiers: TierOutcome | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    error: str | None = None
    index: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class _Group:
    """The n choices of one request: how many are unfinished, and whether choices 1..n-1 were added yet."""

    n: int
    remaining: int
    spawned: bool = False
    cache_salt: str | None = None


@dataclass
class GenerationResult:
    """A finished request, for the synchronous `generate` API."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None
    index: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class EngineStats:
    """Memory accounting and counters, read by the server's /metrics and the dashboard. `evicted_tokens`: KV tokens
    the eviction policy dropped from sequences since the engine started. `spec`: speculative-decoding counters (None
    when the engine does not speculate)."""

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
    evicted_tokens: int = 0
    extra: dict = field(default_factory=dict)
    spec: SpecCounters | None = None

    @property
    def kv_cache_usage_perc(self) -> float:
        return self.blocks.usage_perc


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
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.enable_prefix_caching), self.blocks,
            eviction=self.eviction, budget_blocks=budget_blocks, scores=self.scores,
        )
        exact = FULL_DTYPES.get(self.kv_dtype) == model.dtype
        self.runner = ModelRunner(model.model, self.kv, cfg.block_size, fresh_kv_exact=exact, scores=self.scores)
        self.extra_keys = (model.fingerprint, self.kv_dtype, cfg.block_size)
        self.seqs: dict[str, Sequence] = {}
        self.outputs: dict[str, TextOutput] = {}
        self.groups: dict[str, _Group] = {}
        self._grammars: GrammarCompiler | None = None
        self._ids = itertools.count()
        self.prompt_tokens = self.generation_tokens = self.requests_finished = 0
        self.connector: KVConnector | None = None
        self.nondeterminism = nondeterminism_reasons(self.kv_dtype, cfg.eviction, model.device, model.dtype)
        self.determinism = determinism_header(self.nondeterminism)  # the x-hafiza-deterministic header
        self.spec = SpecCounters()
        self.proposer: NgramProposer | None = None
        if cfg.speculative is not None:
            cfg.speculative.validate()
            if self.eviction is not None:
                raise ConfigError("speculative decoding does not combine with eviction (verified rows would land in "
                                  "blocks the policy may drop)", setting="speculative_method")
            self.proposer = NgramProposer(*cfg.speculative.lookup_range)
            self.scheduler.propose = self._propose

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
        params.validate()
        n = len(prompt_ids)
        if n == 0:
            raise RequestError("the prompt is empty", param="prompt")
        vocab = self.loaded.config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise RequestError(f"prompt contains token ids outside the vocabulary [0, {vocab})", param="prompt")
        bad = [t for t in params.logit_bias if t >= vocab]
        if bad:
            raise RequestError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})",
                               param="logit_bias")
        if params.grammar is not None:
            self.grammars.compile(params.grammar)
        if n + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt of {n} tokens + max_tokens {params.max_tokens} = {n + params.max_tokens} exceeds the "
                f"model's context of {self.max_model_len} tokens", param="max_tokens"
            )
        if n + params.max_tokens > self.capacity_tokens:
            raise RequestError(
                f"prompt of {n} tokens + max_tokens {params.max_tokens} needs "
                f"{-(-(n + params.max_tokens) // self.layout.block_size)} KV blocks but the pool has "
                f"{self.layout.num_blocks} ({self.capacity_tokens} tokens)", param="max_tokens"
            )
        bs = self.layout.block_size
        shared_blocks = n // bs
        group_blocks = shared_blocks + params.n * (-(-(n + params.max_tokens) // bs) - shared_blocks)
        if params.n > 1 and group_blocks > self.layout.num_blocks:
            raise RequestError(
                f"n={params.n} choices of a {n}-token prompt with max_tokens {params.max_tokens} need "
                f"{group_blocks} KV blocks but the pool has {self.layout.num_blocks}; lower n or max_tokens",
                param="n",
            )

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
        if rid in self.seqs or rid in self.groups:
            raise RequestError(f"request id {rid!r} is already in use")
        salt = cache_salt if cache_salt is not None else self.config.cache_salt
        if params.n > 1:
            self.groups[rid] = _Group(params.n, params.n, cache_salt=salt)
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
        self.outputs[sid] = TextOutput(self.tokenizer, params.stop, params.skip_special_tokens,
                                       params.include_stop_str_in_output)
        self.scheduler.add(seq)

    def _spawn_choices(self, first: Sequence) -> None:
        """Add choices 1..n-1 once choice 0 has its prompt's K/V: they reuse its full prompt blocks through the
        prefix cache and compute only the last, partial block themselves."""
        group = self.groups.get(first.group_id)
        if group is None or group.spawned:
            return
        group.spawned = True
        prompt = first.token_ids[: first.num_prompt_tokens]
        for i in range(1, group.n):
            self._add_choice(first.group_id, list(prompt), first.params, group.cache_salt, first.pins, i)

    def abort(self, request_id: str) -> bool:
        """Stop a request (all its choices) and free its blocks; returns False if it was not (or no longer)
        running."""
        group = self.groups.pop(request_id, None)
        ids = [request_id, *(f"{request_id}/{i}" for i in range(1, group.n if group else 1))]
        found = False
        for sid in ids:
            seq = self.seqs.pop(sid, None)
            self.outputs.pop(sid, None)
            if seq is not None:
                self.scheduler.remove(seq)
                seq.finish_reason = "abort"
                found = True
        return found

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
                outputs.append(self._fail(seq, failed[seq.request_id]))
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
        if self.proposer is None or seq.draft_budget is None or seq.needs_prompt_logits:
            return []
        limit = min(room, seq.params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1)
        if limit <= 0:
            return []
        return self.proposer.propose(seq.token_ids, min(limit, seq.draft_budget.allowed()))

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
            keep = -(-seq.num_computed // self.layout.block_size)
            if len(seq.block_table) > keep:
                self.blocks.free(seq.block_table[keep:])
                del seq.block_table[keep:], seq.block_logical[keep:]
        return self._merge(outs)

    @staticmethod
    def _merge(outs: list[RequestOutput]) -> RequestOutput | None:
        """One output for the tokens one step emitted for a sequence: the last output's state, all tokens."""
        if not outs:
            return None
        last = outs[-1]
        last.new_token_ids = [t for o in outs for t in o.new_token_ids]
        last.text = "".join(o.text for o in outs)
        last.logprobs = [lp for o in outs for lp in o.logprobs]
        last.prompt_logprobs = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None)
        return last

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
        for seq, n in zip(batch.seqs, batch.num_new, strict=True):
            alone = ScheduledBatch([seq], [n])
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
                self._record_prompt_logprobs(seq, n, span)
        return logits, last

    @staticmethod
    def _record_prompt_logprobs(seq: Sequence, n: int, logits: torch.Tensor) -> None:
        """Row j of `logits` (position num_computed + j) gives the logprob of the prompt token after it."""
        start, k = seq.num_computed, seq.params.prompt_logprobs or 0
        if start == 0:
            seq.prompt_logprobs = [None]
        if len(seq.prompt_logprobs) < start + 1:
            return  # positions before `start` came from a cache: cannot happen while they are needed
        del seq.prompt_logprobs[start + 1 :]
        last = min(start + n, seq.num_prompt_tokens - 1)
        if last > start:
            targets = seq.token_ids[start + 1 : last + 1]
            seq.prompt_logprobs += token_logprobs(logits[: last - start], targets, k)

    def _fail(self, seq: Sequence, error: str) -> RequestOutput:
        """Finish one request with an error, free its blocks, and cache none of its (possibly partial) K/V."""
        seq.finish_reason = "error"
        self.scheduler.remove(seq)
        self.seqs.pop(seq.request_id, None)
        self.outputs.pop(seq.request_id, None)
        self.requests_finished += 1
        if seq.group_id in self.groups:
            self.groups[seq.group_id].remaining -= 1
            if self.groups[seq.group_id].remaining <= 0:
                self.groups.pop(seq.group_id)
        return RequestOutput(
            request_id=seq.group_id, index=seq.index, new_token_ids=[], text="", finished=True,
            finish_reason="error",
            num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens or 0,
            num_output_tokens=seq.num_output_tokens, arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time, error=error,
        )

    def _observe_prefill(self, num_new: list[int], seconds: float) -> None:
        """Tell the KV tiers' cost model how fast prefill runs here (recompute is the alternative to a load)."""
        tokens = sum(n for n in num_new if n > 1)
        if tokens and self.connector is not None:
            self.connector.observe_prefill(tokens, seconds)

    def _cache_full_blocks(self, seq: Sequence) -> None:
        bs = self.layout.block_size
        full = seq.num_computed // bs
        if seq.evicted:
            seq.num_registered_blocks = full  # K/V computed without the evicted tokens: never offered as a prefix
            return
        if full > seq.num_registered_blocks:
            hashes = seq.hashes(bs)
            self.blocks.cache_chain(seq.block_table, hashes, seq.token_ids, seq.num_registered_blocks, full,
                                   seq.partition)
            if self.connector is not None:
                for b in range(seq.num_registered_blocks, full):
                    self.connector.save(hashes[b], seq.block_table[b])
            seq.num_registered_blocks = full
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
            if seq.grammar is not None and not seq.grammar.accept(token):
                return self._fail(seq, f"sampled token {token} is not allowed by the request's grammar")
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.token_ids.append(token)
            new = [token]
            self.generation_tokens += 1
            if not p.ignore_eos and (token in self.tokenizer.eos_token_ids or token in p.stop_token_ids):
                seq.finish_reason = "stop"
                if p.include_stop_str_in_output:
                    text = text_out.add(token, check_stop=False)
            else:
                text = text_out.add(token, check_stop=seq.num_output_tokens > p.min_tokens)
                if text_out.stop_sequence is not None:
                    seq.finish_reason, seq.stop_sequence = "stop_sequence", text_out.stop_sequence
                elif seq.grammar is not None and seq.grammar.done:
                    seq.finish_reason = "stop"
                elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                    seq.finish_reason = "length"
        else:
            return None
        if seq.index == 0 and p.n > 1:
            self._spawn_choices(seq)
        prompt_logprobs = None
        if seq.index == 0 and p.prompt_logprobs is not None and seq.num_output_tokens <= len(new):
            prompt_logprobs = list(seq.prompt_logprobs)
        logprobs = [seq.pending_logprob] if new and seq.pending_logprob is not None else []
        seq.pending_logprob = None
        finished = seq.finish_reason is not None
        if finished:
            text += text_out.flush() if seq.stop_sequence is None else ""
            self.scheduler.remove(seq)
            self.seqs.pop(seq.request_id, None)
            self.outputs.pop(seq.request_id, None)
            self.prompt_tokens += seq.num_prompt_tokens
            self.requests_finished += 1
            group = self.groups.get(seq.group_id)
            if group is not None:
                group.remaining -= 1
                if group.remaining <= 0:
                    self.groups.pop(seq.group_id)
        return RequestOutput(
            request_id=seq.group_id, index=seq.index, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            new_token_ids=new, text=text, finished=finished,
            finish_reason=seq.finish_reason, stop_sequence=seq.stop_sequence,
            num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens or 0,
            num_output_tokens=seq.num_output_tokens, pinned_tokens=seq.pinned_tokens,
            tiers=seq.tiers,
            arrival_time=seq.arrival_time, first_token_time=seq.first_token_time,
        )

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
                res = acc[(out.request_id, out.index)]
                res.token_ids += out.new_token_ids
                res.text += out.text
                res.logprobs += out.logprobs
                if out.prompt_logprobs is not None:
                    res.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    res.finish_reason, res.error = out.finish_reason, out.error
                    res.num_prompt_tokens, res.num_cached_tokens = out.num_prompt_tokens, out.num_cached_tokens
                    done += 1
        return [acc[k] for k in keys]

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
            blocks=bstats, bytes_per_block=self.bytes_per_block, kv_dtype=self.kv_dtype,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions, prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens, requests_finished=self.requests_finished,
            stored_tokens=stored, waste_slots=bstats.in_use * bs - stored,
            evicted_tokens=self.scheduler.evicted_tokens,
            spec=self.spec.snapshot() if self.config.speculative is not None else None,
        )

    def check_integrity(self) -> None:
        """Block invariants plus: every block referenced by a live sequence has a matching reference, a running
        sequence was admitted, and its registered blocks are cached under its own chain's hashes (or not at all:
        a duplicate of a block cached first elsewhere)."""
        self.blocks.check_integrity()
        refs: dict[int, int] = {}
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            for bid in seq.block_table:
                refs[bid] = refs.get(bid, 0) + 1
            if seq.status is Status.WAITING:
                assert not seq.block_table, f"waiting request {seq.request_id} holds blocks"
                continue
            bs = self.layout.block_size
            assert seq.tiers is not None, f"running request {seq.request_id} has no admission outcome"
            assert seq.num_registered_blocks * bs <= seq.num_computed, (
                f"request {seq.request_id}: {seq.num_registered_blocks} blocks registered, "
                f"{seq.num_computed} tokens computed")
            if not seq.evicted:
                for i, bid in enumerate(seq.block_table[: seq.num_registered_blocks]):
                    held = self.blocks.blocks[bid].hash
                    assert held in (None, seq.block_hashes[i]), (
                        f"request {seq.request_id}: its block {i} (pool block {bid}) is cached under another hash")
        for b in self.blocks.blocks:
            assert refs.get(b.block_id, 0) == b.ref_count, (
                f"block {b.block_id}: ref_count {b.ref_count} but {refs.get(b.block_id, 0)} sequence references")
