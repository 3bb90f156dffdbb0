"""int4 pool, KIVI-style: keys per channel over a block, values per token in channel groups, recent blocks
kept in full precision in a small staging area until they age out."""

from __future__ import annotations

import torch

from hafiza.cache.codes import (
    int4_keys_dequantize,
    int4_keys_quantize,
    int4_values_dequantize,
    int4_values_quantize,
)
from hafiza.cache.errors import KVDtypeError
from hafiza.cache.formats.base import PoolFormat
from hafiza.cache.formats.native import PartSpec
from hafiza.cache.layout import KVLayout
from hafiza.cache.memory import kv_bytes_per_token


def window_dtype_for(layout: KVLayout) -> torch.dtype:
    """The staging area's dtype: the compute dtype when 16-bit, else bf16 (the baseline pool's precision)."""
    return layout.compute_dtype if layout.compute_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


class Int4KV(PoolFormat):
    """Per layer: packed nibbles [blocks, bs, Hkv, d/2] for K and V; K scale/zero fp16 [blocks, Hkv, d]
    (per channel over the block's tokens); V scale/zero fp16 [blocks, bs, Hkv, d/group] (per token).

    Keys need a group of tokens per channel, so a block is written to a full-precision staging slot and
    quantised ("sealed") only when it leaves the staging area, least recently written first. With
    `staging_blocks = max_seqs * (window_blocks + 1)`, each running sequence keeps its partial tail block
    plus its last `window_blocks` full blocks in full precision (exactly so for one sequence; approximately,
    by recency, when sequences interleave). A write into a sealed block (staging too small) dequantises it
    back into staging first; a write at offset 0 starts a new fill. Decisions are taken on the host: one
    device sync per forward step (the slot list is reused across layers).
    """

    kv_dtypes = ("int4",)

    def __init__(self, layout: KVLayout, device: torch.device | str, window_blocks: int = 2,
                 max_seqs: int = 1, value_group: int = 32) -> None:
        super().__init__(layout, device)
        nb, bs, h, d = layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim
        if d % 2:
            raise KVDtypeError(f"int4 KV needs an even head_dim, got {d}")
        if window_blocks < 0 or max_seqs < 1:
            raise KVDtypeError("int4 KV needs window_blocks >= 0 and max_seqs >= 1")
        self.group = value_group if d % value_group == 0 else d
        self.window_blocks, self.max_seqs = window_blocks, max_seqs
        self.staging_blocks = max_seqs * (window_blocks + 1)
        self.window_dtype = window_dtype_for(layout)
        self.kq, self.vq = (self._zeros(nb, bs, h, d // 2, dtype=torch.uint8) for _ in "kv")
        self.kscale, self.kzero = (self._zeros(nb, h, d, dtype=torch.float16) for _ in "sz")
        ng = d // self.group
        self.vscale, self.vzero = (self._zeros(nb, bs, h, ng, dtype=torch.float16) for _ in "sz")
        s = self.staging_blocks
        self.sk, self.sv = (self._zeros(s, bs, h, d, dtype=self.window_dtype) for _ in "kv")
        self.rows = self._zeros(nb, bs, dtype=torch.bool)
        self.stage_of = [torch.full((nb,), -1, dtype=torch.long, device=self.device) for _ in self.kq]
        self._slot_of: list[dict[int, int]] = [{} for _ in self.kq]
        self._use: list[dict[int, int]] = [{} for _ in self.kq]
        self._tick = [0 for _ in self.kq]
        self._slots_key: torch.Tensor | None = None
        self._slots_version = -1
        self._slots_list: list[int] = []

    @classmethod
    def payload_bytes_per_token(cls, layout: KVLayout, value_group: int = 32, **options: int) -> float:
        d, bs = layout.head_dim, layout.block_size
        group = value_group if d % value_group == 0 else d
        k_head, v_head = d / 2 + 4 * d / bs, d / 2 + 4 * d / group
        return kv_bytes_per_token(layout.num_layers, layout.num_kv_heads, (k_head + v_head) / 2)

    @classmethod
    def staging_bytes(cls, layout: KVLayout, window_blocks: int = 2, max_seqs: int = 1) -> int:
        """Fixed bytes of the full-precision staging area (not per token)."""
        item = torch.finfo(window_dtype_for(layout)).bits // 8
        tokens = max_seqs * (window_blocks + 1) * layout.block_size
        return int(tokens * kv_bytes_per_token(layout.num_layers, layout.num_kv_heads, layout.head_dim * item))

    @property
    def bytes_per_token(self) -> float:
        return self.payload_bytes_per_token(self.layout, self.group)

    @property
    def fixed_bytes(self) -> int:
        return self.staging_bytes(self.layout, self.window_blocks, self.max_seqs)

    def staged_blocks(self, layer: int = 0) -> list[int]:
        """Blocks currently held in full precision at `layer`, oldest write first."""
        return sorted(self._slot_of[layer], key=self._use[layer].get)

    def _host_slots(self, slots: torch.Tensor) -> list[int]:
        """slots as a Python list, converted once per step: every layer receives the same tensor (the cached
        list is dropped if the tensor is another one or was modified in place since)."""
        if slots is not self._slots_key or slots._version != self._slots_version:
            self._slots_key, self._slots_version, self._slots_list = slots, slots._version, slots.tolist()
        return self._slots_list

    def _write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        bs = self.block_size
        host = self._host_slots(slots)
        last = {s // bs: i for i, s in enumerate(host)}
        touched = sorted(last, key=last.__getitem__)
        fresh = sorted({s // bs for s in host if s % bs == 0})
        where = {b: i for i, b in enumerate(touched)}
        dev = self.device
        tk = torch.tensor(touched, dtype=torch.long, device=dev)
        if fresh:
            self.rows[layer][torch.tensor(fresh, dtype=torch.long, device=dev)] = False
        work_k, work_v = (x.to(self.window_dtype) for x in self._blocks(layer, tk))
        keep_rows = self.rows[layer][tk]
        work_k, work_v = work_k * keep_rows[:, :, None, None], work_v * keep_rows[:, :, None, None]
        pos = torch.tensor([where[s // bs] for s in host], dtype=torch.long, device=dev)
        off = slots.to(dev) % bs
        work_k[pos, off], work_v[pos, off] = k.to(self.window_dtype), v.to(self.window_dtype)
        self.rows[layer][tk[pos], off] = True
        self._restage(layer, touched, work_k, work_v)

    def _restage(self, layer: int, touched: list[int], work_k: torch.Tensor, work_v: torch.Tensor) -> None:
        """Give the most recently written blocks the staging slots; seal the blocks that lose or lack one."""
        slot_of, use = self._slot_of[layer], self._use[layer]
        tick = self._tick[layer]
        for r, b in enumerate(touched):
            use[b] = tick + r + 1
        self._tick[layer] = tick + len(touched)
        candidates = set(slot_of) | set(touched)
        keep = set(sorted(candidates, key=use.__getitem__)[max(0, len(candidates) - self.staging_blocks):])
        touched_set = set(touched)
        old_out = [b for b in slot_of if b not in keep and b not in touched_set]
        new_out = [i for i, b in enumerate(touched) if b not in keep]
        seal_ids = old_out + [touched[i] for i in new_out]
        if seal_ids:
            old_slots = torch.tensor([slot_of[b] for b in old_out], dtype=torch.long, device=self.device)
            new_idx = torch.tensor(new_out, dtype=torch.long, device=self.device)
            self._seal(layer, seal_ids, torch.cat([self.sk[layer][old_slots], work_k[new_idx]]),
                       torch.cat([self.sv[layer][old_slots], work_v[new_idx]]))
        for b in seal_ids:
            slot_of.pop(b, None)
            use.pop(b, None)
        free = sorted(set(range(self.staging_blocks)) - set(slot_of.values()))
        kept = [i for i, b in enumerate(touched) if b in keep]
        for i in kept:
            if touched[i] not in slot_of:
                slot_of[touched[i]] = free.pop(0)
        if kept:
            dst = torch.tensor([slot_of[touched[i]] for i in kept], dtype=torch.long, device=self.device)
            src = torch.tensor(kept, dtype=torch.long, device=self.device)
            self.sk[layer][dst], self.sv[layer][dst] = work_k[src], work_v[src]
        changed = seal_ids + [touched[i] for i in kept]
        ids = torch.tensor(changed, dtype=torch.long, device=self.device)
        vals = torch.tensor([slot_of.get(b, -1) for b in changed], dtype=torch.long, device=self.device)
        self.stage_of[layer][ids] = vals

    def _seal(self, layer: int, blocks: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantise whole blocks: keys per channel over their written rows, values per token."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        self.kq[layer][idx], self.kscale[layer][idx], self.kzero[layer][idx] = int4_keys_quantize(
            k, self.rows[layer][idx])
        self.vq[layer][idx], self.vscale[layer][idx], self.vzero[layer][idx] = int4_values_quantize(
            v, self.group)

    def _blocks(self, layer: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dt = self.layout.compute_dtype
        k = int4_keys_dequantize(self.kq[layer][idx], self.kscale[layer][idx], self.kzero[layer][idx], dt)
        v = int4_values_dequantize(self.vq[layer][idx], self.vscale[layer][idx], self.vzero[layer][idx],
                                   self.group, dt)
        st = self.stage_of[layer][idx]
        staged = (st >= 0)[:, None, None, None]
        src = st.clamp(min=0)
        k = torch.where(staged, self.sk[layer][src].to(dt), k)
        v = torch.where(staged, self.sv[layer][src].to(dt), v)
        return k, v

    def _store_blocks(self, layer: int, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        ids = idx.tolist()
        for b in ids:
            self._slot_of[layer].pop(b, None)
            self._use[layer].pop(b, None)
        self.stage_of[layer][idx] = -1
        self.rows[layer][idx] = True
        self._seal(layer, ids, k, v)

    def native_spec(self) -> PartSpec:
        bs, h, d = self.layout.block_size, self.layout.num_kv_heads, self.layout.head_dim
        ng, f16 = d // self.group, torch.float16
        return {"codes": ((bs, h, d // 2), torch.uint8), "k_scale": ((h, d), f16), "k_zero": ((h, d), f16),
                "v_scale": ((bs, h, ng), f16), "v_zero": ((bs, h, ng), f16)}

    def _native(self, layer: int, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        """Sealed blocks as stored; a block still in the staging area is sealed into a copy exactly as aging
        out would seal it (the pool keeps it staged), so a loader stores what this pool will hold."""
        kq, ks, kz = self.kq[layer][idx], self.kscale[layer][idx], self.kzero[layer][idx]
        vq, vs, vz = self.vq[layer][idx], self.vscale[layer][idx], self.vzero[layer][idx]
        st = self.stage_of[layer][idx]
        sel = (st >= 0).nonzero().flatten()
        if len(sel):
            slots = st[sel]
            kq[sel], ks[sel], kz[sel] = int4_keys_quantize(self.sk[layer][slots], self.rows[layer][idx[sel]])
            vq[sel], vs[sel], vz[sel] = int4_values_quantize(self.sv[layer][slots], self.group)
        return {"codes": torch.stack([kq, vq]), "k_scale": ks, "k_zero": kz, "v_scale": vs, "v_zero": vz}

    def _store_native(self, layer: int, idx: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        for b in idx.tolist():
            self._slot_of[layer].pop(b, None)
            self._use[layer].pop(b, None)
        self.stage_of[layer][idx] = -1
        self.rows[layer][idx] = True
        self.kq[layer][idx], self.vq[layer][idx] = parts["codes"][0], parts["codes"][1]
        self.kscale[layer][idx], self.kzero[layer][idx] = parts["k_scale"], parts["k_zero"]
        self.vscale[layer][idx], self.vzero[layer][idx] = parts["v_scale"], parts["v_zero"]
