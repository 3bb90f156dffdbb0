"""The `speculative` store codec's predictor: a cheaper copy of the target run in one chunked pass over a prefix.

Any instance that loads a block must reproduce the encoder's prediction bit for bit, whatever prefix length it
loads. The cheaper copy (`hafiza.codec.predictors.cheap`) is built from row-invariant kernels and reads earlier
tokens' K/V back in the store's dtype, so block i's prediction depends only on the tokens up to the end of block i,
whatever the pass's length or chunking (tests/codec/test_cheap_predictor.py): a load of n blocks is one pass of
`chunk`-token forwards, not n block-sized ones. The last few runs are kept, so saving one prompt's blocks in order
(after `hint`), or loading n blocks and then saving the prompt's new ones, costs one pass over the prefix. A
prediction that still differs (another torch build or device) is caught by the codec's per-chunk CRC: decode
raises PredictionMismatchError and the store recomputes the block.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from hafiza.codec.container import DIGEST_BYTES
from hafiza.codec.context import CodecContext
from hafiza.codec.errors import ContextError
from hafiza.codec.formats import BitFormat, tensor_bits
from hafiza.codec.layout import view_shape
from hafiza.codec.predictors.base import BoundPredictor
from hafiza.codec.predictors.cheap import DEFAULT_CHUNK, CheapSpec, PrefixRun, build_cheap_model
from hafiza.codec.predictors.speculative import PrecomputedPrediction, SpeculativePredictor
from hafiza.models.llama import LlamaModel

MAX_RUNS = 4


def default_spec(target: LlamaModel) -> CheapSpec:
    """The predictor a target gets unless told otherwise: its weight values through fp32 GEMMs with bf16-rounded
    inputs on a CPU (0.49 of the int4-served target's prefill, against 0.77-0.80 for int8/int4 copies:
    docs/CODEC.md); on CUDA int8 weights (half the weight bytes of bf16; not measured on a GPU here)."""
    if target.device.type == "cpu":
        return CheapSpec("fp32-bf16in", "fp32")
    return CheapSpec("int8", "bf16" if target.dtype == torch.bfloat16 else "fp32")


class BlockwiseKV:
    """Predicted K/V of a prompt's blocks from the target's cheaper copy, run over the prefix in big chunks.

    Runs are shared by every thread (one at a time, under a lock): the writer thread that encodes a loaded
    prompt's new blocks continues the engine thread's run instead of redoing the prefix. `hint` tells it of a
    prompt's tokens before its blocks are encoded one by one, so the first block's encode runs the whole known
    prompt in one pass rather than one block-sized forward per block."""

    def __init__(self, target: LlamaModel, block_size: int, spec: CheapSpec | None = None,
                 on_run: Callable[[int, float], None] | None = None, kv_dtype: torch.dtype = torch.bfloat16,
                 chunk: int = DEFAULT_CHUNK) -> None:
        """`on_run(tokens, seconds)` hears of every run (wall time), e.g. the cost model's predictor speed;
        `kv_dtype` is the stored blocks' dtype (earlier tokens' K/V are read back in it)."""
        self.target, self.block_size, self.on_run, self.kv_dtype, self.chunk = target, block_size, on_run, \
            kv_dtype, chunk
        self.spec = spec or default_spec(target)
        self.variant = self.spec.label()
        self.model = build_cheap_model(target, self.spec)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._runs: list[PrefixRun] = []
        self._hints: list[list[int]] = []

    def reset(self) -> None:
        """Forget every run and hint (the next request runs from its first token)."""
        with self._lock:
            self._runs, self._hints = [], []

    def hint(self, token_ids: list[int]) -> None:
        """A prompt's tokens known so far (whole blocks are used), whose blocks will be asked for in order."""
        with self._lock:
            self._hints = [h for h in self._hints if h != token_ids[: len(h)]][-(MAX_RUNS - 1):]
            self._hints.append(list(token_ids))

    def _run(self, token_ids: list[int], upto: int) -> tuple[PrefixRun, int]:
        """The run sharing the most leading blocks with `token_ids` (counted up to `upto`), and that count. A few
        runs are kept (least recent dropped), so interleaved saves of concurrent prompts do not redo each other's
        prefixes. Called under the lock."""
        runs = self._runs
        bs, best, best_same = self.block_size, None, -1
        for run in runs:
            same, limit = 0, min(len(run.tokens) // bs, upto)
            while same < limit and run.tokens[same * bs : (same + 1) * bs] == token_ids[same * bs : (same + 1) * bs]:
                same += 1
            if same > best_same:
                best, best_same = run, same
        if best is None or (best_same == 0 and len(runs) < MAX_RUNS):
            best, best_same = PrefixRun(self.model, len(self.target.layers), self.kv_dtype), 0
            runs.append(best)
            if len(runs) > MAX_RUNS:
                runs.pop(0)
        runs.remove(best)
        runs.append(best)
        return best, best_same

    def _target_end(self, token_ids: list[int], end: int) -> list[int]:
        """`token_ids[:end]`, or a hinted prompt that starts with them, cut to whole blocks (under the lock)."""
        longest = token_ids[:end]
        for h in self._hints:
            if len(h) > len(longest) and h[:end] == longest:
                longest = h[: len(h) // self.block_size * self.block_size]
        return list(longest)

    def blocks(self, token_ids: list[int], first: int, count: int) -> list[torch.Tensor]:
        """Predicted blocks `first` … `first + count - 1` of `token_ids` (a whole number of blocks), each
        [layers, 2, block_size, kv_heads, head_dim] in the stored dtype."""
        bs = self.block_size
        end = (first + count) * bs
        if len(token_ids) < end:
            raise ContextError(f"{len(token_ids)} tokens do not cover blocks {first}..{first + count - 1} of {bs}")
        with self._lock:
            run, same = self._run(token_ids, first + count)
            if first + count > same:
                run.truncate(same * bs)
                todo = self._target_end(token_ids, end)
                start = time.perf_counter()
                run.extend(todo[same * bs :], self.chunk)
                seconds = time.perf_counter() - start
                self._local.seconds = self.thread_seconds() + seconds
                if self.on_run is not None:
                    self.on_run(len(todo) - same * bs, seconds)
            k, v = run.kv(first * bs, end)
        kv = torch.stack([k, v], dim=1)  # [layers, 2, count * bs, heads, dim]
        return [kv[:, :, b * bs : (b + 1) * bs] for b in range(count)]

    def advance(self, token_ids: list[int], max_tokens: int) -> int:
        """Grow the run that blocks of `token_ids` (and of a hinted prompt they start) will be read from by at most
        `max_tokens` tokens; returns the tokens still to run (0: covered). Lets the writer run a long pass in
        short slices, giving way to a request between slices instead of competing with it for a whole pass."""
        bs = self.block_size
        step = max(bs, max_tokens // bs * bs)
        with self._lock:
            todo = self._target_end(token_ids, len(token_ids) // bs * bs)
            run, same = self._run(todo, len(todo) // bs)
            have = same * bs
            if have >= len(todo):
                return 0
            run.truncate(have)
            part = todo[have : have + step]
            start = time.perf_counter()
            run.extend(part, self.chunk)
            seconds = time.perf_counter() - start
            self._local.seconds = self.thread_seconds() + seconds
            if self.on_run is not None:
                self.on_run(len(part), seconds)
            return len(todo) - have - len(part)

    def thread_seconds(self) -> float:
        """Wall seconds the calling thread has spent running the predictor."""
        return float(getattr(self._local, "seconds", 0.0))


class BlockPredictor(SpeculativePredictor):
    """The codec's speculative predictor for one stored block: `context.token_ids` is the prefix up to the end
    of the block, and the prediction is that block in the store's layout [block_size, layers·2·heads·dim]."""

    def __init__(self, kv: BlockwiseKV, fingerprint_text: str) -> None:
        super().__init__(kv.target, variant=kv.variant)
        self.kv = kv
        self._fingerprint = hashlib.sha256(
            f"store-blockwise:{kv.variant}:{kv.block_size}:{fingerprint_text}".encode()).digest()[:DIGEST_BYTES]

    def fingerprint(self) -> bytes:
        return self._fingerprint

    def predicted_block(self, context: CodecContext) -> torch.Tensor:
        """The predicted K/V [layers, 2, bs, heads, dim] of the last block of `context.token_ids` (checked first)."""
        self.input_digest(context)
        ids = [int(i) for i in context.token_ids or ()]
        bs = self.kv.block_size
        if not ids or len(ids) % bs:
            raise ContextError(f"a block's prefix must be a whole number of {bs}-token blocks, not {len(ids)} tokens")
        return self.kv.blocks(ids, len(ids) // bs - 1, 1)[0]

    def bind(self, fmt: BitFormat, shape: tuple[int, ...], context: CodecContext) -> BoundPredictor:
        block = self.predicted_block(context)
        pred = block.permute(2, 0, 1, 3, 4).reshape(self.kv.block_size, -1)
        if tuple(pred.shape) != tuple(shape):
            raise ContextError(f"prediction shape {tuple(pred.shape)} but block shape {tuple(shape)}")
        ordered = fmt.to_ordered(tensor_bits(pred.to(fmt.torch_dtype).contiguous())).astype(np.int64)
        return PrecomputedPrediction(fmt, ordered.astype(fmt.uint).reshape(view_shape(tuple(shape))))
