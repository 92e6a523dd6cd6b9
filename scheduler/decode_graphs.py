"""CUDA-graph decode: one captured forward per batch-size bucket, over persistent input buffers.

A decode-only step of R requests (one new token each on top of a state, no prompt logprobs)
replays the graph of the smallest bucket B >= R (1, 2, 4, 8, then every 16 up to max_num_seqs,
as nano-vllm). Prefill and mixed steps, and steps wider than the largest bucket, run eagerly.

Before a replay the step's inputs are copied in place into the buffers the graph was captured
on: one host-to-device copy for the int64 rows (input ids, positions, KV write slots, and each
attention group's write slots when there are several), one for the int32 rows (state slots, seq
lens), and only the block-table rows that changed (device_block_table.py), per group.
Rows R..B-1 are padding that no request owns: KV write slot -1 (nothing written), state slot 0
(the null slot), seq len 1 reading key 0 of a valid block; their logits are dropped.

Inside the captured region nothing reads the device on the host: the kernels get the batch's
host facts as capture-time constants (every row decodes; the longest context is max_model_len,
which fixes the split-KV count of paged attention for the bucket: shares past a request's
context see no key and weigh 0 in the merge). `host_sync_check.NoHostSync` proves it on CPU.

The pools must keep their storage after capture (the graph holds their addresses); every run
checks that and raises if one was reallocated.

mode "cuda" captures torch.cuda.CUDAGraphs; mode "dry_run" (tests, `--cpu-dry-run`) keeps
everything else (buckets, padding, persistent buffers, the in-place table update, the Triton
kernels under TRITON_INTERPRET=1 with HYBRIDKV_BACKEND=triton) and replaces the capture and
replay by a direct call of the same forward on the same buffers.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from hybridkv.kernels.dispatch import backend_for
from hybridkv.models.forward_batch import ForwardBatch, KVGroupTables, ModelCaches

from .device_block_table import DeviceBlockTable
from .host_sync_check import HostSyncError, NoHostSync

MODES = ("cuda", "dry_run")
_INT_PADDING = np.array([[0], [1]])  # a padding row's state slot (the null slot) and seq len


@contextlib.contextmanager
def _triton_kernels():
    """The dry run's forward uses the kernels a GPU replay would (the Triton ones) while the
    eager steps around it keep their backend; HYBRIDKV_BACKEND is process-wide (tests only)."""
    old = os.environ.get("HYBRIDKV_BACKEND")
    os.environ["HYBRIDKV_BACKEND"] = "triton"
    try:
        yield
    finally:
        if old is None:
            del os.environ["HYBRIDKV_BACKEND"]
        else:
            os.environ["HYBRIDKV_BACKEND"] = old


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then multiples of 16, then max_num_seqs."""
    if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs!r} must be a positive integer")
    sizes = [b for b in (1, 2, 4, 8) if b <= max_num_seqs] + list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


@dataclass
class DecodeInputs:
    """One decode step on the host, R requests in batch order (seq len = position + 1).

    token_ids, positions, slot_mapping (KV write slot, -1: none), state_slots: R ints each;
    block_table: int32 CPU tensor [R, W], W <= ceil(max_model_len / block_size); group_tables:
    {window: [R, W'] int32} when the attention layers form several groups (else empty).
    """

    token_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    state_slots: list[int]
    block_table: torch.Tensor
    group_tables: dict = field(default_factory=dict)

    @staticmethod
    def from_chunks(chunks, manager) -> "DecodeInputs":
        """The inputs of a step of one-token decode chunks (scheduler.ScheduledChunk) whose
        requests `manager` (HybridCacheManager) runs."""
        return DecodeInputs._of(manager, [c.seq.request_id for c in chunks],
                                [c.seq.token_ids[c.start] for c in chunks], [c.start for c in chunks],
                                [c.slot_mapping[0] for c in chunks])

    @staticmethod
    def from_batch(batch, manager) -> "DecodeInputs":
        """The inputs of a step_plan.DecodeBatch (allocated) whose requests `manager` runs."""
        return DecodeInputs._of(manager, batch.req_ids, [s.token_ids[-1] for s in batch.seqs],
                                batch.positions.tolist(), batch.kv_slots.tolist())

    @staticmethod
    def _of(manager, rids: list, token_ids: list[int], positions: list[int], slot_mapping: list[int]
            ) -> "DecodeInputs":
        groups = manager.block_tables(rids) if len(manager.attention_groups) > 1 else {}
        return DecodeInputs(token_ids, positions, slot_mapping, manager.live_slots(rids),
                            manager.block_table(rids), groups)


def check_option(option, device: torch.device, tensor_parallel_size: int = 1) -> Optional[str]:
    """The DecodeGraphs mode for LLM's `cuda_graphs` option (None: off); ValueError where it
    cannot work, before anything is built."""
    if option is False or option is None:
        return None
    mode = "cuda" if option is True else option
    if mode not in MODES:
        raise ValueError(f"cuda_graphs={option!r}; choose False, True or 'dry_run' (tests)")
    if mode == "cuda" and torch.device(device).type != "cuda":
        raise ValueError(f"cuda_graphs=True captures CUDA graphs, but the model runs on "
                         f"{torch.device(device)}; leave cuda_graphs off on a CPU")
    if tensor_parallel_size != 1:
        raise ValueError(f"cuda_graphs with tensor_parallel_size={tensor_parallel_size}: a replay "
                         f"builds no model inputs for the executor to send the other ranks; use one "
                         f"or the other")
    return mode


@dataclass
class _Bucket:
    batch: ForwardBatch
    graph: Optional[object]          # torch.cuda.CUDAGraph, None in dry_run
    logits: Optional[torch.Tensor]   # the captured output [B, vocab]; None in dry_run


class DecodeGraphs:
    """Owns the persistent decode inputs and one captured forward per bucket for `model`.

    model: a HybridModel; caches: its pools (never reallocated after `capture`); max_num_seqs:
    the largest bucket; max_model_len / block_size: the block tables' width; windows: the
    attention groups' windows (None: full) when there are several, each with its own table.
    """

    def __init__(self, model, caches: ModelCaches, max_num_seqs: int, max_model_len: int,
                 block_size: int, mode: str = "cuda", windows=()):
        if mode not in MODES:
            raise ValueError(f"decode graph mode {mode!r}; choose one of {MODES}")
        dev = model.device
        if mode == "cuda" and (dev.type != "cuda" or not torch.cuda.is_available()):
            raise ValueError(f"cuda_graphs=True needs the model on a CUDA device; it is on {dev}. "
                             f"Leave cuda_graphs off on a CPU (the dry-run mode is for tests)")
        if mode == "cuda" and backend_for(torch.empty(0, device=dev)) != "triton":
            raise ValueError("cuda_graphs=True captures the Triton kernels, but HYBRIDKV_BACKEND="
                             f"{os.environ.get('HYBRIDKV_BACKEND')!r} forces the torch ones; unset it")
        if mode == "dry_run" and dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("the decode-graph dry run executes the Triton kernels on the CPU: set "
                             "TRITON_INTERPRET=1 before anything imports triton")
        if not max_model_len or max_model_len < 1:
            raise ValueError(f"max_model_len={max_model_len!r}: decode graphs need the longest context")
        self.model, self.caches, self.mode = model, caches, mode
        self.buckets = decode_buckets(max_num_seqs)
        self.max_model_len, self.block_size = int(max_model_len), block_size
        self.max_blocks = -(-self.max_model_len // block_size)
        self.windows = list(windows)
        n = self.buckets[-1]
        pin = mode == "cuda"
        i32, i64 = torch.int32, torch.long
        # device buffers the graphs read; rows of one dtype are one tensor, so one copy fills them:
        # ids, positions, KV write slots, then each group's write slots
        self._longs = torch.zeros(3 + len(self.windows), n, dtype=i64, device=dev)
        self._ints = torch.zeros(2, n, dtype=i32, device=dev)       # state slots, seq lens
        self._query_start = torch.arange(n + 1, dtype=i32, device=dev)
        self._has_initial = torch.ones(n, dtype=torch.bool, device=dev)
        self.tables = DeviceBlockTable(n, self.max_blocks, dev, pin)
        self.group_tables = {w: DeviceBlockTable(n, self.max_blocks, dev, pin) for w in self.windows}
        # host staging (pinned on a GPU)
        self._longs_host = torch.zeros(3 + len(self.windows), n, dtype=i64, pin_memory=pin)
        self._ints_host = torch.zeros(2, n, dtype=i32, pin_memory=pin)
        self._long_padding = np.array([[0], [0]] + [[-1]] * (1 + len(self.windows)))
        self._staged = torch.cuda.Event() if pin else None  # staging is free once this fires
        self._buckets: dict[int, _Bucket] = {}
        self._pool_ptrs: Optional[tuple[int, ...]] = None
        self.replays = 0
        self.rows_uploaded = 0  # block-table rows copied to the device by the last run

    @classmethod
    def for_engine(cls, engine, mode: str) -> "DecodeGraphs":
        """Graphs over a scheduler.Engine's model and pools (a table per attention group),
        captured."""
        groups = engine.mgr.attention_groups
        graphs = cls(engine.runner.model, engine.runner.caches, engine.scheduler.max_seqs, engine.max_model_len,
                     engine.mgr.block_size, mode, windows=list(groups) if len(groups) > 1 else ())
        engine.runner.loads.settle()  # no event is waited on inside a capture (hybridkv/layer_loads.py)
        graphs.capture()
        return graphs

    def takes(self, chunks, logits_indices) -> bool:
        """Whether a step of these scheduler chunks replays a graph: every chunk is one token on
        top of a state, no prompt logprobs are asked, and a bucket holds them."""
        return (logits_indices is None and self.bucket_for(len(chunks)) is not None
                and all(c.num_tokens == 1 and c.start > 0 for c in chunks))

    # ---- capture ---------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture (cuda) or prepare (dry_run) every bucket, largest first, sharing one memory
        pool. Padding rows fill the buffers meanwhile, so capture writes no request's memory."""
        none = torch.zeros(0, 1, dtype=torch.int32)
        self._fill(DecodeInputs([], [], [], [], none, {w: none for w in self.windows}), self.buckets[-1])
        pool = None
        if self.mode == "cuda":  # one-time set-up outside the check (constants moved to the
            with torch.inference_mode():  # device, Triton compiles), as the engine's first step does
                self.model(self._batch(self.buckets[-1]), self.caches)
        for size in reversed(self.buckets):
            batch = self._batch(size)
            if self.mode == "dry_run":
                self._buckets[size] = _Bucket(batch, None, None)
                continue
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode():
                try:  # warm-up: the allocator settles; a sync names its op here, not in the capture
                    with NoHostSync():
                        self.model(batch, self.caches)
                except HostSyncError as e:
                    raise ValueError(f"cuda_graphs: a {self.model.architecture} decode step cannot be "
                                     f"captured ({e}); leave cuda_graphs off for this model") from e
                torch.cuda.synchronize(self.model.device)
                with torch.cuda.graph(graph, pool=pool):
                    logits = self.model(batch, self.caches)
            torch.cuda.synchronize(self.model.device)
            pool = graph.pool()
            self._buckets[size] = _Bucket(batch, graph, logits)
        self._pool_ptrs = self._pool_addresses()

    def _batch(self, size: int) -> ForwardBatch:
        """The bucket's ForwardBatch: views of the persistent buffers, host facts fixed at
        capture (every row a one-token decode; the longest context max_model_len)."""
        groups = {w: KVGroupTables(self.group_tables[w].table[:size], self._longs[3 + k, :size])
                  for k, w in enumerate(self.windows)}
        return ForwardBatch(
            input_ids=self._longs[0, :size], positions=self._longs[1, :size],
            query_start_loc=self._query_start[:size + 1], seq_lens=self._ints[1, :size],
            block_table=self.tables.table[:size], slot_mapping=self._longs[2, :size],
            state_slots=self._ints[0, :size], has_initial_state=self._has_initial[:size],
            return_all_logits=True, query_lens_cpu=[1] * size,
            seq_lens_cpu=[self.max_model_len] * size, kv_groups=groups)

    @property
    def block_table(self) -> torch.Tensor:
        """The device block table [max_num_seqs, max_blocks] (the lead group's)."""
        return self.tables.table

    def _pool_addresses(self) -> tuple[int, ...]:
        c = self.caches
        return tuple(t.data_ptr() for pools in (c.kv, c.conv, c.state) for _, t in sorted(pools.items()))

    # ---- a step ----------------------------------------------------------------------------
    def bucket_for(self, num_reqs: int) -> Optional[int]:
        """The smallest bucket holding num_reqs rows, or None (no graph: run eagerly)."""
        for size in self.buckets:
            if size >= num_reqs:
                return size if num_reqs > 0 else None
        return None

    def run(self, inputs: DecodeInputs) -> torch.Tensor:
        """Float32 logits [R, vocab] of one decode step; the KV and states advance in the pools.
        Raises ValueError for a batch no bucket holds and RuntimeError when the pools moved."""
        if not self._buckets:
            raise RuntimeError("decode graphs were not captured; call capture() first")
        num_reqs = len(inputs.token_ids)
        size = self.bucket_for(num_reqs)
        if size is None:
            raise ValueError(f"a decode batch of {num_reqs} requests; decode graphs hold 1.."
                             f"{self.buckets[-1]} (max_num_seqs)")
        if self._pool_addresses() != self._pool_ptrs:
            raise RuntimeError("a KV or state pool was reallocated after the decode graphs were "
                               "captured; the graphs would write freed memory. Recapture them")
        self._fill(inputs, size)
        bucket = self._buckets[size]
        self.replays += 1
        if bucket.graph is None:  # dry run: the captured region's body, held to capture's rules
            with torch.inference_mode(), _triton_kernels(), NoHostSync():
                return self.model(bucket.batch, self.caches)[:num_reqs]
        bucket.graph.replay()
        return bucket.logits[:num_reqs]

    def _fill(self, inputs: DecodeInputs, size: int) -> None:
        """Copy the step's inputs into the buffers' first `size` rows (rows past R: padding).
        Every input is checked before anything is written."""
        r = len(inputs.token_ids)
        if not (len(inputs.positions) == len(inputs.slot_mapping) == len(inputs.state_slots) == r):
            raise ValueError(f"decode inputs disagree on the batch size: {r} tokens, "
                             f"{len(inputs.positions)} positions, {len(inputs.slot_mapping)} KV "
                             f"slots, {len(inputs.state_slots)} state slots")
        table = inputs.block_table.numpy()
        self.tables.check(table, r)
        if sorted(inputs.group_tables, key=str) != sorted(self.windows, key=str):
            raise ValueError(f"decode inputs bring tables for attention groups "
                             f"{sorted(inputs.group_tables, key=str)}; the graphs have {self.windows}")
        groups = [inputs.group_tables[w].numpy() for w in self.windows]
        for w, t in zip(self.windows, groups):
            self.group_tables[w].check(t, r)
        if self._staged is not None:
            self._staged.synchronize()  # last step's copies have left the staging buffers
        longs, ints = self._longs_host.numpy(), self._ints_host.numpy()
        longs[0, :r], longs[1, :r], longs[2, :r] = inputs.token_ids, inputs.positions, inputs.slot_mapping
        pos, bs = longs[1, :r], self.block_size
        for k, t in enumerate(groups):  # each group's write slot, derived from its table
            longs[3 + k, :r] = t[np.arange(r), pos // bs].astype(np.int64) * bs + pos % bs
        ints[0, :r] = inputs.state_slots
        ints[1, :r] = pos + 1
        longs[:, r:size] = self._long_padding  # token 0 at position 0, no KV write
        ints[:, r:size] = _INT_PADDING         # the null state slot; one key read
        nb = self._staged is not None
        # whole buffers (a few KiB): contiguous on both sides, so the copy is one async DMA
        self._longs.copy_(self._longs_host, non_blocking=nb)
        self._ints.copy_(self._ints_host, non_blocking=nb)
        self.rows_uploaded = self.tables.update(table, size, nb) + sum(
            self.group_tables[w].update(t, size, nb) for w, t in zip(self.windows, groups))
        if self._staged is not None:
            self._staged.record()
