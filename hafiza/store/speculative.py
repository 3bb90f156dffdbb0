"""The `speculative` store codec's predictor: a cheaper rerun of the target over a block's prefix tokens.

Any instance that loads a block must reproduce the encoder's prediction bit for bit, whatever prefix length it
loads. One forward over T tokens does not give that: its rows' rounding can depend on T (on this CPU the first
320 rows of a 401-token run differ from a 320-token run). So the predictor runs block by block: each block of
`block_size` tokens is one forward step that attends to the predicted K/V of the blocks before it. Block i's
prediction depends only on tokens[: (i + 1) * block_size], computed by the same operations on the same shapes
in every run. Each thread keeps its last run, so saving one prompt's blocks in order, or loading n blocks,
costs one pass over the prefix. A prediction that still differs (another torch build or device) is caught by
the codec's per-chunk CRC: decode raises PredictionMismatchError and the store recomputes the block.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from hafiza.codec.container import DIGEST_BYTES
from hafiza.codec.context import CodecContext
from hafiza.codec.errors import ContextError
from hafiza.codec.formats import BitFormat, tensor_bits
from hafiza.codec.layout import view_shape
from hafiza.codec.predictors.base import BoundPredictor
from hafiza.codec.predictors.forward import PredictorModel
from hafiza.codec.predictors.speculative import SpeculativePredictor, _Bound
from hafiza.models.llama import LlamaModel, rms_norm
from hafiza.models.rope import apply_rope

DEFAULT_VARIANT = "bf16-mixed"  # the codec's own default; int8 (torch._int_mm) ran ~6x slower per token on this CPU
MAX_RUNS = 2


@dataclass
class _Run:
    """One thread's last block-by-block run: its tokens and, per layer, the predicted K and V of every block."""

    tokens: list[int] = field(default_factory=list)
    k: list[list[torch.Tensor]] = field(default_factory=list)
    v: list[list[torch.Tensor]] = field(default_factory=list)


class BlockwiseKV:
    """The target's weights at a cheaper precision (`PredictorModel`), run one block of tokens at a time."""

    def __init__(self, target: LlamaModel, block_size: int, variant: str = DEFAULT_VARIANT,
                 on_run: Callable[[int, float], None] | None = None) -> None:
        """`on_run(tokens, seconds)` hears of every run (wall time), e.g. the cost model's predictor speed."""
        self.target, self.block_size, self.variant, self.on_run = target, block_size, variant, on_run
        self.model = PredictorModel(target, variant, 0)
        self._local = threading.local()

    def _run(self, token_ids: list[int], upto: int) -> tuple[_Run, int]:
        """This thread's run sharing the most leading blocks with `token_ids` (at most `upto`), and that count.

        A few runs are kept per thread (least recent dropped), so interleaved saves of concurrent prompts do
        not redo each other's prefixes."""
        runs: list[_Run] | None = getattr(self._local, "runs", None)
        if runs is None:
            runs = self._local.runs = []
        bs, best, best_same = self.block_size, None, -1
        for run in runs:
            same, limit = 0, min(len(run.tokens) // bs, upto)
            while same < limit and run.tokens[same * bs : (same + 1) * bs] == token_ids[same * bs : (same + 1) * bs]:
                same += 1
            if same > best_same:
                best, best_same = run, same
        if best is None or (best_same == 0 and len(runs) < MAX_RUNS):
            best, best_same = _Run(k=[[] for _ in self.target.layers], v=[[] for _ in self.target.layers]), 0
            runs.append(best)
            if len(runs) > MAX_RUNS:
                runs.pop(0)
        runs.remove(best)
        runs.append(best)
        if best_same < len(best.tokens) // bs:
            del best.tokens[best_same * bs :]
            for layer in range(len(best.k)):
                del best.k[layer][best_same:], best.v[layer][best_same:]
        return best, best_same

    def blocks(self, token_ids: list[int], first: int, count: int) -> list[torch.Tensor]:
        """Predicted blocks `first` … `first + count - 1` of `token_ids` (a whole number of blocks), each
        [layers, 2, block_size, kv_heads, head_dim] in fp32."""
        bs = self.block_size
        if len(token_ids) < (first + count) * bs:
            raise ContextError(f"{len(token_ids)} tokens do not cover blocks {first}..{first + count - 1} of {bs}")
        run, same = self._run(token_ids, first + count)
        start = time.perf_counter()
        for b in range(same, first + count):
            self._step(run, token_ids[b * bs : (b + 1) * bs])
        if first + count > same:
            seconds = time.perf_counter() - start
            self._local.seconds = self.thread_seconds() + seconds
            if self.on_run is not None:
                self.on_run((first + count - same) * bs, seconds)
        return [
            torch.stack([torch.stack([run.k[i][b], run.v[i][b]]) for i in range(len(run.k))])
            for b in range(first, first + count)
        ]

    @torch.inference_mode()
    def _step(self, run: _Run, chunk: list[int]) -> None:
        """One block forward: attend to every earlier block's predicted K/V, append this block's."""
        m, c, pm = self.target, self.target.config, self.model
        p0, t = len(run.tokens), len(chunk)
        ids = torch.tensor(chunk, dtype=torch.long, device=m.device)
        positions = torch.arange(p0, p0 + t, device=m.device)
        cos, sin = m.rope.cos_sin(positions, p0 + t - 1)
        mask = torch.ones(t, p0 + t, dtype=torch.bool, device=m.device).tril(diagonal=p0)
        x = m.embed(ids).to(m.dtype)
        for i, lw in enumerate(m.layers):
            lin = pm.linears[i]
            h = rms_norm(x, lw.input_norm, c.rms_norm_eps)
            q, k, v = lin("qkv", h).split([m.q_size, m.kv_size, m.kv_size], dim=-1)
            q = apply_rope(q.reshape(t, c.num_heads, c.head_dim).float(), cos, sin)
            k = apply_rope(k.reshape(t, c.num_kv_heads, c.head_dim).float(), cos, sin)
            v = v.reshape(t, c.num_kv_heads, c.head_dim).float()
            run.k[i].append(k)
            run.v[i].append(v)
            kc, vc = torch.cat(run.k[i]), torch.cat(run.v[i])
            qh, kh, vh = (a.transpose(0, 1).unsqueeze(0) for a in (q, kc, vc))
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=c.num_heads != c.num_kv_heads)
            attn = o[0].transpose(0, 1).reshape(t, m.q_size)
            x = x + lin("o", attn).to(x.dtype)
            h = rms_norm(x, lw.post_norm, c.rms_norm_eps)
            gate, up = lin("gate_up", h).chunk(2, dim=-1)
            x = x + lin("down", F.silu(gate) * up).to(x.dtype)
        run.tokens.extend(chunk)

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

    def bind(self, fmt: BitFormat, shape: tuple[int, ...], context: CodecContext) -> BoundPredictor:
        self.input_digest(context)
        ids = [int(i) for i in context.token_ids or ()]
        bs = self.kv.block_size
        if not ids or len(ids) % bs:
            raise ContextError(f"a block's prefix must be a whole number of {bs}-token blocks, not {len(ids)} tokens")
        block = self.kv.blocks(ids, len(ids) // bs - 1, 1)[0]
        pred = block.permute(2, 0, 1, 3, 4).reshape(bs, -1)
        if tuple(pred.shape) != tuple(shape):
            raise ContextError(f"prediction shape {tuple(pred.shape)} but block shape {tuple(shape)}")
        ordered = fmt.to_ordered(tensor_bits(pred.to(fmt.torch_dtype).contiguous())).astype(np.int64)
        return _Bound(fmt, ordered.astype(fmt.uint).reshape(view_shape(tuple(shape))))
