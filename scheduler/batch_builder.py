"""The packed batch of a step: one `ForwardBatch` built from the scheduled chunks.

For a model on an accelerator, every integer it reads (token ids, positions, slot mappings, query
starts, lengths, state slots, the block table of every attention group, the logits indices) is
written into ONE preallocated int64 host buffer (pinned when the model is on CUDA), moved to the device in one
copy, and cut there into the batch's fields (the int32 and bool fields are cast on the device).
Positions and lengths come from the chunks' starts with numpy, and each group's slot mapping is
derived from its block table (`block * block_size + pos % block_size`), not read from lists.
On the CPU there is nothing to transfer: each field is a tensor over its own array, made this
step in the field's dtype (no shared buffer, no clone, no casts), so no batch aliases another's.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from hybridkv.models.forward_batch import ForwardBatch, KVGroupTables

from .step_plan import DecodeBatch


class BatchBuilder:
    """Builds each step's ForwardBatch for `manager`'s requests on `device` (see module doc)."""

    def __init__(self, manager, device: torch.device | str):
        self.mgr = manager
        self.device = torch.device(device)
        self._pinned = self.device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.long)
        self._host_np = self._host.numpy()
        self._copied: Optional[torch.cuda.Event] = None  # set while a copy may still read _host

    def build(self, chunks: Sequence, logits_indices: Optional[Sequence[int]] = None) -> ForwardBatch:
        """chunks: the step's ScheduledChunks in batch order (seq, start, num_tokens), every
        sequence running in the manager with its blocks allocated for the chunk.
        logits_indices: token indices whose logits come back (None: the model's default rule).
        Returns the batch on the builder's device; T tokens over R = len(chunks) requests."""
        counts = [c.num_tokens for c in chunks]
        starts = [c.start for c in chunks]
        rids = [c.seq.request_id for c in chunks]
        if sum(counts) == len(chunks):  # every chunk a decode: one token each
            ids = [c.seq.token_ids[c.start] for c in chunks]
        else:
            ids = []
            for c in chunks:
                if c.draft:  # its last token, then the draft it verifies
                    ids.append(c.seq.token_ids[c.start])
                    ids.extend(c.draft)
                else:
                    ids.extend(c.seq.token_ids[c.start:c.start + c.num_tokens])
        mgr = self.mgr
        groups = {w: t.numpy() for w, t in mgr.block_tables(rids).items()} if len(mgr.attention_groups) > 1 else {}
        if groups:
            lead = next(groups[w] for w, g in mgr.attention_groups.items() if g is mgr.attention)
        else:
            lead = mgr.block_table(rids).numpy()
        state_slots = mgr.live_slots(rids)
        verify = {i: list(c.verify_slots) for i, c in enumerate(chunks) if c.verify_slots}
        for i, chain in verify.items():  # a verifying run starts from its chain's first slot
            state_slots[i] = chain[0]
        batch = self._build(ids, np.array(starts, dtype=np.int64), counts, lead, groups, state_slots,
                            logits_indices)
        batch.verify_slots = verify
        return batch

    def build_decodes(self, batch: DecodeBatch) -> ForwardBatch:
        """The batch of a DecodeBatch (allocated): one token per sequence, its last."""
        rows = batch.rows
        if self.device.type == "cpu" and len(rows.groups) <= 1:
            return self._cpu_decodes(batch)
        groups = {w: g.table() for w, g in rows.groups.items()}
        lead = next((groups[w] for w, g in rows.groups.items() if g is rows.lead), None)
        if lead is None:  # no attention layers
            lead = np.zeros((len(rows), 1), dtype=np.int32)
        if len(groups) == 1:  # one group: block_table and slot_mapping serve every layer
            groups = {}
        return self._build([s.token_ids[-1] for s in batch.seqs], batch.positions, None, lead, groups,
                           rows.state_slots.copy(), None, batch.kv_slots)  # no batch aliases the handle

    def _cpu_decodes(self, batch: DecodeBatch) -> ForwardBatch:
        """build_decodes on the CPU with at most one attention group: the fields that stay the
        same while the batch lives (query starts, state slots, has_initial_state: a decode is past
        its prompt) are made once and shared by its steps (nothing writes a batch's fields); the
        token ids are the tensor the step before sampled, when it did."""
        n = len(batch)
        fixed = batch.cpu_fields
        if fixed is None:
            fixed = batch.cpu_fields = (
                torch.from_numpy(np.arange(n + 1, dtype=np.int32)), torch.from_numpy(batch.rows.state_slots.copy()),
                torch.from_numpy(np.ones(n, dtype=np.bool_)), [1] * n)  # (torch.arange: ~0.2 ms here)
        qsl, state_slots, has_initial_state, query_lens = fixed
        ids = batch.input_ids
        if ids is None:
            ids = torch.tensor([s.token_ids[-1] for s in batch.seqs], dtype=torch.long)
        lead = batch.rows.lead
        table = lead.table() if lead is not None else np.zeros((n, 1), dtype=np.int32)
        seq_lens = batch.positions + 1
        return ForwardBatch(
            input_ids=ids, positions=torch.from_numpy(batch.positions), slot_mapping=torch.from_numpy(batch.kv_slots),
            query_start_loc=qsl, seq_lens=torch.from_numpy(seq_lens.astype(np.int32)), state_slots=state_slots,
            has_initial_state=has_initial_state, block_table=torch.from_numpy(table),
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens.tolist())

    def _build(self, ids: list[int], start: np.ndarray, counts: Optional[list[int]], lead: np.ndarray,
               groups: dict, state_slots, logits_indices: Optional[Sequence[int]],
               lead_slots: Optional[np.ndarray] = None) -> ForwardBatch:
        """R requests' counts[r] tokens (None: one each) from position start[r] (int64); ids: the
        batch's token ids, request after request; lead: the lead attention group's block table
        [R, W] (int32 numpy); groups: {window: table} of every group when there are several,
        else {}; state_slots: R live slots; lead_slots: the lead group's slot mapping when known
        (else derived from its table)."""
        mgr, bs = self.mgr, self.mgr.block_size
        num_reqs = len(start)
        num_tokens = len(ids)
        if counts is None:
            count, qsl = 1, np.arange(num_reqs + 1, dtype=np.int64)
        else:
            count = np.array(counts, dtype=np.int64)
            qsl = np.zeros(num_reqs + 1, dtype=np.int64)
            np.cumsum(count, out=qsl[1:])
        if num_tokens == num_reqs:
            rows, positions = np.arange(num_reqs), start
        else:  # token t of request r sits at start[r] + (t - qsl[r])
            rows = np.repeat(np.arange(num_reqs), count)
            positions = np.arange(num_tokens) + (start - qsl[:-1])[rows]

        def slots(table: np.ndarray) -> np.ndarray:
            return table[rows, positions // bs].astype(np.int64) * bs + positions % bs

        if lead_slots is None:
            lead_slots = slots(lead) if mgr.attention is not None else np.full(num_tokens, -1, dtype=np.int64)
        seq_lens = start + count

        parts: list = [ids, positions, lead_slots, qsl, seq_lens, state_slots, start > 0, lead]
        for table in groups.values():
            parts += [table, slots(table)]
        if logits_indices is not None:
            parts.append(logits_indices)
        if self.device.type == "cpu":  # nothing to transfer: each field a tensor over its own array
            kinds = [np.int64, np.int64, np.int64, np.int32, np.int32, np.int32, np.bool_, np.int32]
            kinds += [np.int32, np.int64] * len(groups) + [np.int64] * (logits_indices is not None)
            views = [torch.from_numpy(np.asarray(p, dtype=k)) for p, k in zip(parts, kinds)]

            def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
                return t  # made in its dtype and shape
        else:
            _, views = self._transfer(parts)
            views[7] = views[7].view(lead.shape)
            for k, table in enumerate(groups.values()):
                views[8 + 2 * k] = views[8 + 2 * k].view(table.shape)

            def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
                return t.to(dtype)
        i32 = torch.int32
        batch = ForwardBatch(
            input_ids=views[0], positions=views[1], slot_mapping=views[2],
            query_start_loc=cast(views[3], i32), seq_lens=cast(views[4], i32), state_slots=cast(views[5], i32),
            has_initial_state=cast(views[6], torch.bool), block_table=cast(views[7], i32),
            logits_indices=views[-1] if logits_indices is not None else None,
            query_lens_cpu=[1] * num_reqs if counts is None else counts, seq_lens_cpu=seq_lens.tolist())
        for k, w in enumerate(groups):
            batch.kv_groups[w] = KVGroupTables(cast(views[8 + 2 * k], i32), views[9 + 2 * k])
        return batch

    def _transfer(self, parts: list) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Write `parts` (lists or arrays of integers) one after another into the host buffer,
        move it to the device in one copy; returns (the device tensor, a flat int64 view per part)."""
        sizes = [p.size if isinstance(p, np.ndarray) else len(p) for p in parts]  # np.size would convert a list
        total = sum(sizes)
        host = self._host_buffer(total)
        offsets = [0]
        for p, n in zip(parts, sizes):
            o = offsets[-1]
            if n:
                host[o:o + n] = np.ravel(p) if isinstance(p, np.ndarray) else p
            offsets.append(o + n)
        src = self._host[:total]
        if self._pinned:
            packed = src.to(self.device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            packed = src.clone()
        return packed, [packed[offsets[k]:offsets[k + 1]] for k in range(len(parts))]

    def _host_buffer(self, n: int) -> np.ndarray:
        """A numpy view of >= n int64 host elements no pending copy still reads."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's transfer may still be reading it
            self._copied = None
        if self._host.numel() < n:
            self._host = torch.empty(max(n, 2 * self._host.numel(), 4096), dtype=torch.long,
                                     pin_memory=self._pinned)
            self._host_np = self._host.numpy()
        return self._host_np
