"""Quantized pools seen by the model: read in place by the decode kernels that take codes, else each
layer's rows a step touches decoded before the layer runs and encoded back after it.

Under a quantized cache dtype (hybridkv/cache_dtype.py) a pool holds codes and scales. In a step of
one-token decodes the caches offer each layer its pool's codes (`ModelCaches.kv_codes`,
`state_codes`: QuantizedPages / QuantizedState with the step's own tables and slots); a layer whose
kernel reads them (PagedAttention, Mamba2Mixer in float32: C kernels on the CPU, Triton on CUDA)
updates them in place and is never staged. For everything else `CacheStaging.stage` gives the model
a batch whose state slots and KV block ids are renumbered into small working tensors (in a step of
decodes, the KV tables only when a layer first asks for pages), and caches whose `kv[i]`, `conv[i]`
and `state[i]` are those working tensors in the layer's compute dtype, made when the layer first
asks for them (`_StagedLayers`): the rows of the step's slots, or the blocks its requests' tables
name, decoded straight from the pool (quantize.decode_gather). When the model asks for a third entry
of one kind while two are staged (and at the end of the step) the one asked for longest ago is
encoded back into the pool (quantize.encode_scatter): every slot of the step (the kernels wrote
them) and the KV vectors of the tokens the step wrote. Every kernel, mixer and attention variant
runs unchanged on values that are exactly what the pool keeps; the working tensors live in two
buffers per kind, kept between steps (a layer finds its rows at the same address each step, so the C
calls built for them are reused). tests/engine/test_cache_staging.py holds every family to a
reference that decodes the whole pools.

The arithmetic is that of kernels which would dequantize on read and quantize on write: a state is
quantized each time it is written to its slot (after each decoded token, at the end of each
prefill chunk, after each verified draft token), a KV vector when its token is written. Within one
prefill chunk the chunk's own keys and the state between its tokens stay at full precision, as in
vLLM's fp8 KV cache; so quantized output depends on how the prompt was chunked and on prefix hits
(docs/design.md, "Quantized caches").
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Optional

import numpy as np
import torch

from hybridkv.cache_dtype import QuantLayout
from hybridkv.kernels import attention_decode_quantized, quantize
from hybridkv.kernels.attention_decode_quantized import page_runs
from hybridkv.models.forward_batch import ForwardBatch, KVGroupTables, ModelCaches, QuantizedPages, QuantizedState


class _StagedLayers(Mapping):
    """{layer: working tensor} over one pool kind. `load(i)` -> the layer's working tensor; `store(i,
    work)` encodes it back. At most KEEP layers are staged at a time: asking for another stores the
    one asked for longest ago (a model runs its layers one after the other; a layer may read two
    entries of one kind at once: an attention layer's pages and its indexer's, GLM-5-Next and
    Qwen4-Exp)."""

    KEEP = 2

    def __init__(self, keys, load: Callable[[int, int], torch.Tensor], store: Callable[[int, torch.Tensor], None],
                 layout: Callable[[int], Optional[QuantLayout]]):
        self._keys, self._load, self._store, self._layout = list(keys), load, store, layout
        self._staged: dict[int, tuple[torch.Tensor, int]] = {}  # layer -> (working tensor, its seat)

    def layout_of(self, t: torch.Tensor) -> Optional[QuantLayout]:
        """The layout of the staged layer whose working tensor `t` is (or views)."""
        for i, (work, _) in self._staged.items():
            if t.untyped_storage().data_ptr() == work.untyped_storage().data_ptr():
                return self._layout(i)
        return None

    def __getitem__(self, i: int) -> torch.Tensor:
        """The layer's working tensor, loaded into a free seat (0 .. KEEP-1: which of the staging's
        buffers it lives in) when it is not staged: the seat of the one stored to make room, so a
        model running its layers in the same order each step gives each layer the same buffer."""
        got = self._staged.get(i)
        if got is None:
            if i not in self._keys:
                raise KeyError(i)
            seats = set(range(self.KEEP))
            for _, seat in self._staged.values():
                seats.discard(seat)
            while not seats:
                oldest = next(iter(self._staged))
                work, seat = self._staged.pop(oldest)
                self._store(oldest, work)
                seats.add(seat)
            seat = min(seats)
            got = self._staged[i] = (self._load(i, seat), seat)
        return got[0]

    def __iter__(self) -> Iterator[int]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def flush(self) -> None:
        staged, self._staged = self._staged, {}
        for i, (work, _) in staged.items():
            self._store(i, work)


class CacheStaging:
    """The quantized pools of `manager`, staged step by step (`stage`). `seed`: of the stochastic
    rounding of int8 codes when `stochastic` (None: round to nearest)."""

    def __init__(self, manager, stochastic: bool = False, seed: int = 0):
        self.block_size = manager.block_size
        self.kv_layouts: dict[int, tuple[QuantLayout, torch.dtype, Optional[int]]] = {}
        for window, group in manager.attention_groups.items():
            for i, spec in group.layers.items():
                if spec.layout is not None:
                    self.kv_layouts[i] = (spec.layout, spec.dtype, window)
        self.state_layouts: dict[str, dict[int, tuple[QuantLayout, torch.dtype]]] = {"conv": {}, "ssm": {}}
        if manager.recurrent is not None:
            for i, spec in manager.recurrent.layers.items():
                if spec.conv_layout is not None:
                    self.state_layouts["conv"][i] = (spec.conv_layout, spec.dtype)
                if spec.ssm_layout is not None:
                    self.state_layouts["ssm"][i] = (spec.ssm_layout, spec.ssm_dtype)
        self._buffers: dict[tuple, torch.Tensor] = {}  # (kind, seat, dtype) -> a flat working buffer
        self.generator = None
        if stochastic:
            pools = list(manager.kv_caches.values()) + list(manager.conv_states.values())
            self.generator = torch.Generator(device=pools[0].device if pools else "cpu")
            self.generator.manual_seed(seed)

    @property
    def active(self) -> bool:
        return bool(self.kv_layouts or self.state_layouts["conv"] or self.state_layouts["ssm"])

    def stage(self, batch: ForwardBatch, caches: ModelCaches) -> tuple[ForwardBatch, ModelCaches, Callable[[], None]]:
        """(the batch renumbered into the working tensors, the caches the model reads, a call that
        encodes what is still staged: run it after the forward)."""
        changes: dict = {"kernel_plans": {}}
        conv, state = caches.conv, caches.state
        if self.state_layouts["conv"] or self.state_layouts["ssm"]:
            rows, renumber = self._slot_rows(batch)
            changes["state_slots"] = renumber(batch.state_slots)
            changes["verify_slots"] = {r: renumber(torch.tensor(s)).tolist() for r, s in batch.verify_slots.items()}
            conv = self._staged_slots(caches.conv, self.state_layouts["conv"], rows, "conv")
            state = self._staged_slots(caches.state, self.state_layouts["ssm"], rows, "ssm")
            if batch.verify_slots:
                changes["requantize"] = self._requantize([conv, state])
        decodes = self._decodes_only(batch)
        kv, groups = caches.kv, {}
        if self.kv_layouts and not decodes:
            groups.update(self._kv_groups(batch))
            changes.update(self._kv_changes(batch, groups))
        staged_batch = dataclasses.replace(batch, **changes)
        if self.kv_layouts:
            def renumbered() -> None:
                """In a step of decodes, where layers may read their codes in place, the KV tables are
                renumbered when the first layer asks for working pages (its caller has them before it
                reads the batch's tables; the layers reading codes were given the step's own)."""
                if not groups:
                    groups.update(self._kv_groups(batch))
                    for name, value in self._kv_changes(batch, groups).items():
                        setattr(staged_batch, name, value)
            kv = self._staged_pages(caches.kv, groups, bool(batch.kv_groups), renumbered)
        staged = [m for m in (kv, conv, state) if isinstance(m, _StagedLayers)]

        def finish() -> None:
            for m in staged:
                m.flush()
        return staged_batch, ModelCaches(
            kv=kv, conv=conv, state=state, block_size=caches.block_size,
            kv_codes=self._kv_codes(batch, caches.kv) if decodes and self.kv_layouts else None,
            state_codes=self._state_codes(batch, caches) if decodes and self.state_layouts["ssm"] else None), finish

    @staticmethod
    def _kv_changes(batch: ForwardBatch, groups: dict) -> dict:
        """The batch's KV tables renumbered into the working pages of `groups` (_kv_groups)."""
        if not batch.kv_groups:
            return {"block_table": groups[None].table, "slot_mapping": groups[None].slot_mapping}
        changes = {"kv_groups": {**batch.kv_groups,
                                 **{w: KVGroupTables(g.table, g.slot_mapping) for w, g in groups.items()}}}
        lead = next((w for w, t in batch.kv_groups.items() if w in groups
                     and torch.equal(t.block_table, batch.block_table)), None)
        if lead is not None:  # the batch's own table is the lead group's
            changes["block_table"], changes["slot_mapping"] = groups[lead].table, groups[lead].slot_mapping
        return changes

    def _decodes_only(self, batch: ForwardBatch) -> bool:
        """A step where layers may read codes in place: one-token decodes only, none verifying a
        draft, int8 rounding to nearest (the C kernels' encode)."""
        lens = batch.query_lens_cpu or (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).tolist()
        return self.generator is None and not batch.verify_slots and all(n == 1 for n in lens)

    def _state_codes(self, batch: ForwardBatch, caches: ModelCaches):
        """ModelCaches.state_codes for a step of one-token decodes: layer i's conv and state pools as
        QuantizedState with the step's own slots, where both are quantized, the layer computes in
        float32 and a kernel reads them (C on the CPU, Triton on CUDA); else None (the layer reads
        conv[i] and state[i])."""
        conv_layouts, ssm_layouts = self.state_layouts["conv"], self.state_layouts["ssm"]
        slots = batch.state_slots

        def state_codes(i: int) -> Optional[QuantizedState]:
            if i not in conv_layouts or i not in ssm_layouts or conv_layouts[i][1] != torch.float32 \
                    or ssm_layouts[i][1] != torch.float32 or caches.state[i].device.type not in ("cpu", "cuda"):
                return None
            return QuantizedState(caches.conv[i], conv_layouts[i][0], caches.state[i], ssm_layouts[i][0], slots)
        return state_codes

    def _kv_codes(self, batch: ForwardBatch, pools: Mapping[int, torch.Tensor]):
        """ModelCaches.kv_codes for a step of one-token decodes: layer i's pool as QuantizedPages
        with the step's own tables, where the layer computes in float32 and a kernel reads that pool
        in place on its device (C on the CPU, Triton on CUDA); else None (the layer reads kv[i])."""
        tables: dict = {}

        def kv_codes(i: int) -> Optional[QuantizedPages]:
            layout, dtype, window = self.kv_layouts.get(i, (None, None, None))
            if layout is None or dtype != torch.float32 or not attention_decode_quantized.reads_in_place(pools[i], layout):
                return None
            got = tables.get(window)
            if got is None:  # once per KV group: every new token has a slot
                table, slots, _ = batch.kv_tables(window)
                got = tables[window] = (table, slots) if bool((slots >= 0).all()) else False
            return QuantizedPages(pools[i], layout, *got) if got else None
        return kv_codes

    # ---- recurrent slots -------------------------------------------------------------------
    @staticmethod
    def _slot_rows(batch: ForwardBatch):
        """(the pool slots the step touches, null slot 0 first, as a long tensor; a function
        renumbering slot ids into positions among them)."""
        used = [batch.state_slots.cpu().numpy().astype(np.int64)]
        used += [np.asarray(s, dtype=np.int64) for s in batch.verify_slots.values()]
        rows = np.unique(np.concatenate([np.zeros(1, dtype=np.int64)] + used))  # sorted: slot 0 first
        device = batch.state_slots.device

        def renumber(slots: torch.Tensor) -> torch.Tensor:
            pos = np.searchsorted(rows, slots.cpu().numpy().astype(np.int64))
            return torch.from_numpy(pos.astype(np.int32)).to(device)
        return torch.from_numpy(rows).to(device), renumber

    @staticmethod
    def _requantize(staged: list) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """ForwardBatch.requantize over the working tensors of `staged` (a layer may hand them on as
        views: found by their storage)."""
        def requantize(t: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
            for m in staged:
                layout = m.layout_of(t) if isinstance(m, _StagedLayers) else None
                if layout is not None:
                    rows = t[slots]
                    x = rows.reshape(rows.shape[0], *layout.shape)
                    return quantize.decode(layout, quantize.encode(layout, x), t.dtype).reshape(rows.shape)
            raise ValueError("requantize: a state tensor that is none of this step's working tensors")
        return requantize

    def _staged_slots(self, pools: Mapping[int, torch.Tensor], layouts: dict, rows: torch.Tensor, kind: str):
        if not layouts:
            return pools
        written = rows[1:]  # the null slot is never kept
        work_rows = []  # 1 .. len(rows) - 1, made at the first store

        def load(i: int, seat: int) -> torch.Tensor:
            layout, dtype = layouts[i]
            out = self._work((kind, seat), (rows.numel(), *layout.shape), dtype, pools[i].device)
            return quantize.decode_gather(layout, pools[i], rows, 1, out)

        def store(i: int, work: torch.Tensor) -> None:
            if not work_rows:
                work_rows.append(torch.arange(1, rows.numel(), device=rows.device))
            quantize.encode_scatter(layouts[i][0], work, work_rows[0], pools[i], written, 1, self.generator)
        return _StagedLayers(pools.keys(), load, store, lambda i: layouts[i][0])

    def _work(self, key: tuple, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        """A working tensor of `shape` in the buffer of `key` (kind, seat), kept between steps (so a
        layer finds its rows at the same address each step: the C decode calls built for its pools
        are kept, mamba2_native.Mamba2MixerDecode); grown when a step needs more."""
        n = math.prod(shape)
        buf = self._buffers.get((*key, dtype))
        if buf is None or buf.numel() < n or buf.device != torch.device(device):
            buf = self._buffers[(*key, dtype)] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n].view(shape)

    # ---- KV pages --------------------------------------------------------------------------
    def _kv_groups(self, batch: ForwardBatch) -> dict[Optional[int], "_PageRows"]:
        """{window: its _PageRows} for each group of layers that keeps quantized pages (one, keyed
        None, when the batch has one table for every layer)."""
        bs = self.block_size
        seq_lens = batch.seq_lens.cpu().numpy().astype(np.int64)
        windows = {w for _, _, w in self.kv_layouts.values()} if batch.kv_groups else {None}
        out = {}
        for w in windows:
            table, slots, _ = batch.kv_tables(w)
            t = table.cpu().numpy().astype(np.int64)
            valid = np.arange(t.shape[1])[None, :] < np.minimum(-(-seq_lens // bs), t.shape[1])[:, None]
            valid &= t >= 0  # entries past a request's blocks may hold anything
            blocks = np.unique(t[valid]) if valid.any() else np.zeros(1, dtype=np.int64)
            renumbered = np.where(valid, np.searchsorted(blocks, np.where(valid, t, blocks[0])), 0)
            s = slots.cpu().numpy().astype(np.int64)
            keep = s >= 0
            new_slots = np.full_like(s, -1)
            new_slots[keep] = np.searchsorted(blocks, s[keep] // bs) * bs + s[keep] % bs
            dev = table.device
            out[w] = _PageRows(torch.from_numpy(blocks).to(dev), torch.from_numpy(renumbered.astype(np.int32)).to(dev),
                               torch.from_numpy(new_slots).to(slots.device), torch.from_numpy(s[keep]).to(dev),
                               torch.from_numpy(new_slots[keep]).to(dev))
        return out

    def _staged_pages(self, pools: Mapping[int, torch.Tensor], groups: dict, grouped: bool,
                      renumbered: Callable[[], None]):
        def load(i: int, seat: int) -> torch.Tensor:  # every attention layer keeps quantized pages (with_cache_dtypes)
            renumbered()  # (groups filled)
            layout, dtype, window = self.kv_layouts[i]
            g, pool = groups[window if grouped else None], pools[i]
            per_block = math.prod(pool.shape[1:-1])  # items: [blocks, 2, block_size, heads]
            out = self._work(("kv", seat), (g.blocks.numel(), *pool.shape[1:-1], *layout.shape), dtype, pool.device)
            return quantize.decode_gather(layout, pool, g.blocks * per_block, per_block, out)

        def store(i: int, work: torch.Tensor) -> None:
            layout, _, window = self.kv_layouts[i]
            g, pool = groups[window if grouped else None], pools[i]
            if g.pool_written.numel():
                src, dst = page_runs(g.work_written, pool.shape), page_runs(g.pool_written, pool.shape)
                quantize.encode_scatter(layout, work, src, pool, dst, pool.shape[3], self.generator)
        return _StagedLayers(pools.keys(), load, store, lambda i: self.kv_layouts[i][0])


@dataclass
class _PageRows:
    """One KV group's part of a step: `blocks` the pool blocks its tables name (sorted), `table` and
    `slot_mapping` renumbered into them, and the token slots the step writes, in the pool
    (`pool_written`) and in the working pages (`work_written`)."""

    blocks: torch.Tensor
    table: torch.Tensor
    slot_mapping: torch.Tensor
    pool_written: torch.Tensor
    work_written: torch.Tensor
