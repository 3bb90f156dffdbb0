"""StoreConnector: the engine's KVConnector over a TieredStore (RAM → disk → Redis), one codec per tier.

- `save` (engine thread): copy the full block out of the pool in its native form (`read_native`: a
  quantised pool's codes and scales, never dequantised; see store/native.py) and hand it to the store's one background
  pipeline (`TieredStore.put_async`) with a function that, on the store's writer thread, skips tiers that
  already hold the key and encodes the block with each remaining tier's codec (once per codec). The engine
  thread never waits on a codec or on I/O; a full queue drops the save (counted).
- `lookup` (engine thread, at admission): the longest prefix some tier holds, and the cost model's plan: load
  and decode, load and rerun the predictor on the prefix tokens and decode (a tier with the `speculative`
  codec), or recompute — from stored bytes over measured tier bandwidth, measured decode time per codec,
  measured predictor speed, against tokens over the measured prefill speed (`observe_prefill`).
- `load` (engine thread): takes the `TierHit` that `lookup` returned; fetch, decode (the codec's checksums; a
  corrupt entry is dropped from every tier), write into the pool, and promote blocks into the faster tiers
  (re-encoded when their codec differs) through the pipeline. A decode failure of any kind, including
  PredictionMismatchError (this instance cannot reproduce the encoder's prediction), ends the load there: the
  rest is recomputed and counted (`decode_fallbacks`), so output is never wrong. It returns a `TierLoad`.

TTL (only Redis applies one; RAM and disk evict by LRU): a block under an API cache breakpoint (`CachePin`,
Anthropic `cache_control`) is written with the pin's TTL (e.g. 1 h), never less than the default; any other
block gets `default_ttl_s` (5 min, the API's default cache TTL).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from hafiza.cache.formats.native import NativeBlocks, block_nbytes, stack
from hafiza.codec.coders.fast import warm_up
from hafiza.codec.errors import PredictionMismatchError
from hafiza.engine.connector import KVConnector, SavedBlock, TierHit, TierLoad
from hafiza.errors import ConfigError
from hafiza.store.codecs import DEFAULT_STORE_CODEC, TOKEN_CODECS, check_codec
from hafiza.store.gate import ServingGate
from hafiza.store.host_gate import host_gate
from hafiza.store.keys import block_key
from hafiza.store.logs import store_log
from hafiza.store.native import check_predictable, decode_native, encode_native
from hafiza.store.redis_store import DEFAULT_TTL_S
from hafiza.store.speculative import BlockPredictor, BlockwiseKV
from hafiza.store.tiered import Fallback, TieredStore

if TYPE_CHECKING:
    from hafiza.cache.pool import KVPool
    from hafiza.engine.engine import LLMEngine
    from hafiza.models.llama import LlamaModel


FALLBACK_CODEC = "fast"  # what a speculative tier stores a block in when the cost model would not load it predicted

MustLoad = Callable[[Sequence[str]], "str | None"]


@dataclass
class ConnectorStats:
    """Counters of the connector's own work (the tiers count theirs in `TieredStore.stats`)."""

    saves: int = 0
    saves_skipped: int = 0
    saves_dropped: int = 0
    encode_errors: int = 0
    encoded_blocks: int = 0
    encodes: dict[str, int] = field(default_factory=dict)  # blocks encoded per codec (fallback codec included)
    lookups: int = 0
    loads: int = 0
    blocks_loaded: int = 0
    blocks_corrupt: int = 0
    prediction_mismatches: int = 0
    decode_fallbacks: int = 0
    predictor_seconds: float = 0.0
    lookup_errors: int = 0
    decisions: dict[str, int] = field(
        default_factory=lambda: {"load": 0, "predict": 0, "recompute": 0, "miss": 0})


@dataclass(frozen=True)
class StoreHit(TierHit):
    """A TierHit that also carries what `load` needs again: the prefix tokens (for the speculative codec's
    predictor), the index of the hit's first block in the prompt and the cost model's plan."""

    token_ids: tuple[int, ...] = ()
    first_block: int = 0
    plan: str = "load"


class _Average:
    """An exponential moving average that starts at its first sample."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha, self.value, self.samples = alpha, 0.0, 0

    def add(self, x: float) -> None:
        self.value = x if self.samples == 0 else self.value + self.alpha * (x - self.value)
        self.samples += 1


class StoreConnector(KVConnector):
    """Write-through of full blocks, prefix lookup with a cost model, verified loads; see the module docstring."""

    def __init__(
        self,
        store: TieredStore,
        pool: KVPool,
        *,
        model_fingerprint: str,
        kv_dtype: str,
        codec: str = DEFAULT_STORE_CODEC,
        tier_codecs: dict[str, str] | None = None,
        default_ttl_s: float | None = DEFAULT_TTL_S,
        target: LlamaModel | None = None,
        gate: ServingGate | None = None,
    ) -> None:
        """Blocks are stored in the pool's native form (`pool.native_spec()`); `codec` is every tier's codec unless
        `tier_codecs` names another for a tier (by tier name). `target` is the model whose cheaper rerun predicts K/V
        (needed by `speculative`; a saved block brings its own tokens and pin).
        `gate` (the engine's busy/idle state) keeps speculative encodes off the serving path."""
        self.store, self.pool = store, pool
        self.codec = check_codec(codec)
        unknown = set(tier_codecs or {}) - set(store.names)
        if unknown:
            raise ConfigError(f"codec given for tier(s) {sorted(unknown)}, but the tiers are {store.names}",
                              setting="store_codec")
        self.codecs = [check_codec((tier_codecs or {}).get(name, codec)) for name in store.names]
        if "fast" in self.codecs:
            warm_up()  # the fast coder's decode kernel is compiled code: load it now, not on the first hit
        if store.write_back and len(set(self.codecs)) > 1:
            given = ", ".join(f"{n}={c}" for n, c in zip(store.names, self.codecs, strict=True))
            raise ConfigError(f"write-back needs one codec for every tier, got {given} (an entry leaving RAM is "
                              "written down as it is)", setting="store_write_back")
        if kv_dtype != pool.kv_dtype:
            raise ConfigError(f"the store keys blocks as {kv_dtype} KV but the pool stores {pool.kv_dtype}",
                              setting="kv_dtype")
        check_predictable(kv_dtype, self.codecs)
        self.model_fingerprint, self.kv_dtype = model_fingerprint, kv_dtype
        self.num_layers, self.block_size = pool.layout.num_layers, pool.block_size
        self.spec = pool.native_spec()
        self.raw_block_bytes = block_nbytes(self.spec, self.num_layers)
        self.default_ttl_s = default_ttl_s
        self.predictor: BlockPredictor | None = None
        if TOKEN_CODECS & set(self.codecs):
            if target is None:
                raise ConfigError("the speculative codec needs the model that predicts K/V (use for_engine)",
                                  setting="store_codec")
            kv = BlockwiseKV(target, self.block_size, on_run=self._observe_predict,
                             kv_dtype=pool.block_dtype)
            self.predictor = BlockPredictor(kv, f"{model_fingerprint}:{kv_dtype}")
        self.gate = gate or ServingGate()
        self.must_load: MustLoad | None = None  # why a hit's blocks are loaded whatever the cost model says, or None
        self._step_mark = self.gate.marks()
        self.fallback = [FALLBACK_CODEC if c in TOKEN_CODECS and not store.write_back else None
                         for c in self.codecs]
        if any(self.fallback):
            warm_up()
        self.stats = ConnectorStats()
        known = set(self.codecs) | {c for c in self.fallback if c}
        self._stored_bytes = {c: _Average() for c in known}
        self._decode_s = {c: _Average() for c in known}
        self._lock = threading.Lock()
        self._predict_mark = threading.local()  # the gate's mark when this thread's encode began
        self._closed = False
        store.bind_keys(self._tier_key, self._fallback_key)

    @classmethod
    def for_engine(
        cls, engine: LLMEngine, store: TieredStore, *, codec: str = DEFAULT_STORE_CODEC,
        tier_codecs: dict[str, str] | None = None, default_ttl_s: float | None = DEFAULT_TTL_S,
    ) -> StoreConnector:
        """A connector for `engine`'s pool, model fingerprint, KV dtype, block size and cache pins. Stored blocks
        are the pool's native form: the storage dtype of a full-precision pool (e.g. bf16 under fp32 compute),
        a quantised pool's codes and scales."""
        model_fp, kv_dtype, block_size = engine.extra_keys
        assert engine.kv.block_size == block_size, f"pool blocks hold {engine.kv.block_size} tokens, the engine " \
            f"says {block_size}"
        return cls(
            store, engine.kv, model_fingerprint=model_fp, kv_dtype=kv_dtype,
            codec=codec, tier_codecs=tier_codecs, default_ttl_s=default_ttl_s, target=engine.runner.model,
            gate=ServingGate(idle_check=lambda: not engine.has_unfinished(), host=host_gate()),
        )  # fmt: skip

    def _tier_key(self, j: int, block_hash: str) -> str:
        return block_key(block_hash, self.model_fingerprint, self.kv_dtype, self.block_size, self.codecs[j])

    def _fallback_key(self, j: int, block_hash: str) -> str | None:
        """Tier j's key for a block stored in its fallback codec (None: the tier has no fallback)."""
        codec = self.fallback[j]
        return None if codec is None else block_key(block_hash, self.model_fingerprint, self.kv_dtype,
                                                    self.block_size, codec)

    def key(self, block_hash: str, tier: int = 0) -> str:
        """The store key of a block in a tier (default the first): its chained prefix hash qualified by model,
        KV dtype, block size and the tier's codec."""
        return self._tier_key(tier, block_hash)

    def _observe_predict(self, num_tokens: int, seconds: float) -> None:
        """A predictor run's speed; a run on the writer thread while the engine served is marked contended."""
        with self._lock:
            self.stats.predictor_seconds += seconds
            mark = getattr(self._predict_mark, "mark", None)
        contended = mark is not None and ServingGate.overlapped(mark, self.gate.marks(), "serve")
        self.store.cost.observe_predict(num_tokens, seconds, contended)

    def _thread_predict_s(self) -> float:
        """Seconds this thread has spent in predictor runs (decode time is measured without them)."""
        return self.predictor.kv.thread_seconds() if self.predictor is not None else 0.0

    # -- save: the engine thread copies; the store's pipeline encodes per tier codec and writes -------------

    def save(self, saved: SavedBlock) -> None:
        """Copy the block out and queue it (dropped, and counted, when the pipeline is too far behind)."""
        if self._closed:
            return
        self.stats.saves += 1
        block_hash, block_id = saved.block_hash, saved.block_id
        try:
            block = self.pool.read_native([block_id])
            tokens = saved.tokens() if self.predictor is not None else None
            if tokens and self.predictor is not None:
                self.predictor.kv.hint(tokens)  # the writer's first encode then runs every block saved so far at once
        except Exception:
            store_log.error(f"connector {id(self)} copy", "store: cannot copy block %d out of the pool; not saved",
                            block_id, exc_info=True)  # fmt: skip
            return
        nbytes = block.nbytes
        if not self.store.put_async(block_hash, self._encoder(block_hash, block, tokens), self._ttl(saved.pin_ttl_s),
                                    raw_nbytes=nbytes):
            self.stats.saves_dropped += 1

    def _ttl(self, pinned: float | None) -> float | None:
        """The pin's TTL for a block under a cache breakpoint (never below the default), else the default."""
        if self.default_ttl_s is None:
            return None
        return max(self.default_ttl_s, pinned or 0.0)

    def _encoder(self, block_hash: str, block: NativeBlocks, tokens: list[int] | None, skip_present: bool = True
                 ) -> Callable[[int], bytes | Fallback | None]:
        """Tier j's bytes for a block, on the pipeline thread: None when the tier holds it already (or it cannot
        be coded for that tier); each codec encodes once. A speculative tier gets its fallback codec's bytes
        (`Fallback`) unless the cost model would load the block predicted."""
        blobs: dict[str, bytes | None] = {}
        skipped: list[int] = []
        pays: list[bool] = []

        def value_for(j: int) -> bytes | Fallback | None:
            if skip_present and self.store.tiers[j].contains(self._tier_key(j, block_hash)):
                skipped.append(j)
                if len(skipped) == len(self.store.tiers if not self.store.write_back else self.store.tiers[:1]):
                    self.stats.saves_skipped += 1
                return None
            codec = self.codecs[j]
            if self.fallback[j] is not None and not pays:
                pays.append(self._predicted_load_pays(j, tokens))  # once per block, for every speculative tier
            fallback = self.fallback[j] is not None and not pays[0]
            if fallback:
                codec = self.fallback[j] or codec
            if codec not in blobs:
                blobs[codec] = self._encode(block_hash, block, codec, tokens)
            blob = blobs[codec]
            return Fallback(blob) if fallback and blob is not None else blob

        return value_for

    def _predicted_load_pays(self, j: int, tokens: list[int] | None) -> bool:
        """Whether the cost model, with its current speeds, would load this block's prefix from tier j with the
        predictor rather than recompute it: only then is the block worth a speculative encode."""
        if not tokens:
            return False
        n = len(tokens) // self.block_size
        codec = self.codecs[j]
        with self._lock:
            avg = self._stored_bytes[codec]
            nbytes = int(n * (avg.value if avg.samples else self.raw_block_bytes))
            decode_s = self._decode_s[codec].value * n
        d = self.store.cost.decide(n * self.block_size, {self.store.names[j]: nbytes}, decode_s, n * self.block_size)
        return d.plan == "predict"

    def _predict_ahead(self, tokens: list[int]) -> None:
        """Run the predictor over a block's prefix (and the rest of its hinted prompt) one chunk per gate slice:
        each slice starts only while the engine is idle, so a request that arrives mid-pass shares the CPU with at
        most one chunk's forward, not with the whole pass. A run that others keep truncating ends the loop (3 slices
        without progress); the encode then runs what is left."""
        kv = self.predictor.kv if self.predictor is not None else None
        if kv is None or not tokens:
            return
        left, stalls = -1, 0
        while stalls < 3:
            with self.gate.encoding():
                self._predict_mark.mark = self.gate.marks()
                try:
                    now = kv.advance(tokens, kv.chunk)
                finally:
                    self._predict_mark.mark = None
            if now == 0:
                return
            stalls = stalls + 1 if 0 <= left <= now else 0
            left = now

    def _encode(self, block_hash: str, block: NativeBlocks, codec: str, tokens: list[int] | None) -> bytes | None:
        try:
            if codec in TOKEN_CODECS and not tokens:
                raise ValueError("the block's tokens are unknown (its sequence is no longer running)")
            if codec in TOKEN_CODECS:
                self._predict_ahead(tokens or [])
                with self.gate.encoding():  # starts only while the engine is idle
                    self._predict_mark.mark = self.gate.marks()
                    blob = encode_native(block, codec, tokens, self.predictor)
                    self._predict_mark.mark = None
            else:
                blob = encode_native(block, codec, tokens, self.predictor)
        except Exception:
            with self._lock:
                self.stats.encode_errors += 1
            store_log.error(f"connector {id(self)} encode", "store: encoding block %s with %s failed; not saved",
                            block_hash, codec, exc_info=True)  # fmt: skip
            return None
        with self._lock:
            self._stored_bytes[codec].add(len(blob))
            self.stats.encoded_blocks += 1
            self.stats.encodes[codec] = self.stats.encodes.get(codec, 0) + 1
        return blob

    # -- lookup and load: engine thread, at admission ------------------------------------------------------

    def lookup(self, hashes: Sequence[str], token_ids: Sequence[int] = (), first_block: int = 0) -> TierHit:
        """The tiers' longest run of `hashes` (blocks `first_block`… of the prompt `token_ids`) and whether
        loading it beats recomputing.

        Runs on the engine thread, so it never raises: any failure is a miss (the request recomputes).
        """
        self.stats.lookups += 1
        if not hashes or self._closed:
            return TierHit()
        try:
            return self._lookup(hashes, token_ids, first_block)
        except Exception as e:
            self.stats.lookup_errors += 1
            self.stats.decisions["miss"] += 1
            store_log.error(f"connector {id(self)} lookup", "store: lookup of %d blocks failed; recomputing",
                            len(hashes), exc_info=True)  # fmt: skip
            return TierHit(reason=f"miss: store lookup failed ({type(e).__name__}: {e})")

    def _lookup(self, hashes: Sequence[str], token_ids: Sequence[int], first_block: int) -> TierHit:
        found = self.store.lookup_prefix(hashes)
        n = found.num_hits
        if n == 0:
            self.stats.decisions["miss"] += 1
            return TierHit(reason=f"miss: none of the next {len(hashes)} blocks is in a store tier")
        index = {name: j for j, name in enumerate(self.store.names)}
        by_tier: dict[str, int] = {}
        decode_s, predicted = 0.0, False
        alts = found.fallback or [False] * n
        labels = []
        with self._lock:
            for name, alt in zip(found.sources, alts, strict=True):
                j = index[name]
                codec = (self.fallback[j] or self.codecs[j]) if alt else self.codecs[j]
                avg = self._stored_bytes[codec]
                by_tier[name] = by_tier.get(name, 0) + int(avg.value if avg.samples else self.raw_block_bytes)
                decode_s += self._decode_s[codec].value
                predicted = predicted or codec in TOKEN_CODECS
                labels.append(f"{name}.{codec}" if alt else name)
        end = (first_block + n) * self.block_size
        if predicted and len(token_ids) < end:
            self.stats.decisions["miss"] += 1
            return TierHit(reason=f"miss: the speculative codec needs the prefix tokens, {len(token_ids)} given")
        decision = self.store.cost.decide(n * self.block_size, by_tier, decode_s, end if predicted else 0)
        forced = self.must_load(hashes[:n]) if self.must_load is not None and not decision.load else None
        if forced:
            decision = replace(decision, load=True, plan="predict" if predicted else "load",
                               reason=f"load: {forced} (the cost model alone would have said {decision.reason})")
        self.stats.decisions[decision.plan] += 1
        return StoreHit(tuple(hashes[:n]), tuple(labels), decision.load, decision.reason,
                        tuple(token_ids[:end]), first_block, decision.plan)

    def load(self, hit: TierHit, block_ids: Sequence[int]) -> TierLoad:
        """Fetch, verify and write the hit's leading blocks into `block_ids`; which arrived intact, from where."""
        names = list(hit.hashes[: len(block_ids)])
        tokens = list(hit.token_ids) if isinstance(hit, StoreHit) else []
        first = hit.first_block if isinstance(hit, StoreHit) else 0
        self.stats.loads += 1
        blocks: list[NativeBlocks] = []
        note = ""
        try:
            fetched = self.store.load(names)
            alts = fetched.fallback or [False] * len(fetched.values)
            for i, (name, value, j) in enumerate(zip(names, fetched.values, fetched.sources, strict=False)):
                codec = (self.fallback[j] or self.codecs[j]) if alts[i] else self.codecs[j]
                prefix = tokens[: (first + i + 1) * self.block_size] if codec in TOKEN_CODECS else None
                t0, p0 = time.perf_counter(), self._thread_predict_s()
                try:
                    block = decode_native(value, self.kv_dtype, self.num_layers, self.spec, prefix, self.predictor)
                except Exception as exc:
                    note = self._decode_failed(name, j, exc)
                    break
                seconds = time.perf_counter() - t0 - (self._thread_predict_s() - p0)
                with self._lock:
                    self._decode_s[codec].add(max(seconds, 0.0))
                blocks.append(block)
                if j > 0:
                    self.store.put_async(name, self._promoter(name, value, codec, block, prefix), None,
                                         raw_nbytes=self.raw_block_bytes, targets=range(j))
            if blocks:
                self.pool.write_native(list(block_ids[: len(blocks)]), stack(blocks))
        except Exception:
            store_log.error(f"connector {id(self)} load", "store: loading %d blocks failed; recomputing them",
                            len(names), exc_info=True)  # fmt: skip
            blocks = []
        n = len(blocks)
        self.stats.blocks_loaded += n
        if n < len(names):
            why = f" ({note})" if note else ""
            note = f"only {n} of {len(names)} blocks arrived intact, the rest were recomputed{why}"
        return TierLoad(tuple(hit.sources[:n]), note)

    def _promoter(self, name: str, value: bytes, source_codec: str, block: NativeBlocks, tokens: list[int] | None
                  ) -> Callable[[int], bytes | Fallback | None]:
        """A hit's bytes for a faster tier: the same bytes where the codec is the source's, else re-encoded."""
        encode = self._encoder(name, block, tokens, skip_present=False)

        def value_for(j: int) -> bytes | Fallback | None:
            return value if self.codecs[j] == source_codec else encode(j)

        return value_for

    def _decode_failed(self, name: str, tier: int, exc: Exception) -> str:
        """A block that cannot be decoded here is recomputed (counted). A damaged one is deleted from every tier;
        one whose prediction this instance cannot reproduce is left for instances that can."""
        self.stats.decode_fallbacks += 1
        codec = self.codecs[tier]
        if isinstance(exc, PredictionMismatchError):
            self.stats.prediction_mismatches += 1
            store_log.warning(f"connector {id(self)} mismatch",
                              "store: block %s (%s): the predictor's rerun differs from the encoder's; recomputing",
                              name, codec)  # fmt: skip
            return f"block {name[:12]} from {self.store.names[tier]}: the predictor's rerun differs from the encoder's"
        self.stats.blocks_corrupt += 1
        store_log.warning(
            f"connector {id(self)} corrupt",
            "store: block %s is corrupt (%s); dropped from every tier, recomputing", name, exc,
        )  # fmt: skip
        for j, t in enumerate(self.store.tiers):
            t.delete(self._tier_key(j, name))
        return f"block {name[:12]} from {self.store.names[tier]} failed to decode: {type(exc).__name__}"

    # -- engine hooks and shutdown ---------------------------------------------------------------------------

    def serving(self, busy: bool) -> None:
        """Engine thread: a forward is about to run (True) or nothing is left to run (False); speculative
        encodes wait for False."""
        if busy:
            self._step_mark = self.gate.marks()
        self.gate.serving(busy)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """Measured prefill speed: the recompute side of the cost model; a step during which an encode ran is
        marked contended (used only until a quiet step is measured)."""
        contended = ServingGate.overlapped(self._step_mark, self.gate.marks(), "encode")
        self.store.cost.observe_prefill(num_tokens, seconds, contended)

    def flush(self, timeout_s: float = 30.0) -> bool:  # type: ignore[override]
        """Encode and write everything queued down every tier; False on timeout."""
        return self.store.flush(timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Flush pending writes, stop the pipeline and close the tiers."""
        if self._closed:
            return
        self._closed = True
        self.gate.close()
        self.store.close(timeout_s)
