"""HybridCacheManager: the one object the scheduler talks to about memory; the coordinator of kinds.

A model's layers fall into kinds of memory (hybridkv/memory/): full-attention KV, sliding-window
KV, recurrent state. Each kind implements the same verbs for its own pool; this class runs each
verb over the model's kinds and is the one place that says how their answers combine:
- a verb that can be refused (admit, allocate, fork, resume, import) asks every kind first and
  changes nothing unless all agree; kinds that can refuse for lack of a slot are asked first;
- a prefix is usable only as far as EVERY kind can resume it (its `prefix_cache`, prefix_cache.py,
  which also hashes blocks and keeps state checkpoints);
- one budget is planned across kinds (`plan()`), each pool sized exactly, none padded.
Attention layers form one group per window (`attention_groups`, None: full attention), each with
its own pool share and block tables. The verbs take the scheduler's `Request` objects (kept by
id, never copied) and change their memory fields. Kinds: memory/kinds.py; a draft run's verbs:
draft_runs.py; a decode batch's: decode_rows.py; snapshots: snapshot_transfer.py; swap: swap.py.
Invariant at every step boundary: every kind holds the request's memory of exactly
`num_computed_tokens` tokens. The verbs over each kind: docs/design.md ("The manager's verbs").
"""
from __future__ import annotations

import types
from typing import Hashable, Mapping, Optional, Sequence

import torch

from hybridkv import snapshot_transfer, swap
from hybridkv.checkpoint_policy import DEFAULT_POLICY, HOST_TIER_TRAIL, CheckpointPolicy
from hybridkv.decode_rows import DecodeRows
from hybridkv.draft_runs import DraftRuns
from hybridkv.eviction import DEFAULT_EVICTION
from hybridkv.errors import MemoryBudgetError, RequestStateError, RequestTooLargeError
from hybridkv.layer_loads import LayerLoads
from hybridkv.manager_stats import ManagerStats
from hybridkv.memory.disk_reader import DEFAULT_READ_AHEAD_BYTES
from hybridkv.memory.disk_tier import DEFAULT_DISK_CACHE_BYTES, DiskTier
from hybridkv.memory.full_attention import FullAttentionMemory
from hybridkv.memory.kinds import make_kinds
from hybridkv.memory.layer_memory import LayerMemory
from hybridkv.memory.recurrent import RecurrentMemory
from hybridkv.plan import plan
from hybridkv.prefix_cache import PrefixCache
from hybridkv.request import Request, RequestStatus
from hybridkv.snapshot import RequestSnapshot
from hybridkv.specs import LayerSpec

RUNNING, WAITING, SWAPPED = RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.SWAPPED


class HybridCacheManager:
    """Coordinator of the model's kinds of layer memory; see the module docstring."""

    def __init__(self, specs: Mapping[int, LayerSpec], block_size: int = 16,
                 num_blocks: int | Mapping[Optional[int], int] = 0,
                 num_slots: int = 0, *, device: torch.device | str = "cpu", enable_prefix_caching: bool = True,
                 checkpoint_policy: str = DEFAULT_POLICY, checkpoint_every_n: int = 4,
                 checkpoint_eviction: str = DEFAULT_EVICTION, fingerprint: str = "",
                 flops_per_token: Optional[float] = None, max_num_batched_tokens: Optional[int] = None,
                 draft_slots: int = 0, host_cache_bytes: int = 0, disk_cache_dir: Optional[str] = None,
                 disk_cache_bytes: int = DEFAULT_DISK_CACHE_BYTES, disk_read_ahead: bool = True):
        if not isinstance(block_size, int) or block_size <= 0:
            raise MemoryBudgetError(f"block_size={block_size!r} must be a positive integer (e.g. 16)")
        kinds = make_kinds(specs, block_size, num_blocks, num_slots, device, checkpoint_eviction,
                           flops_per_token, max_num_batched_tokens, draft_slots, host_cache_bytes)
        self.specs = dict(specs)
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.attention_groups: dict[Optional[int], FullAttentionMemory] = kinds.attention_groups
        self.attention: Optional[FullAttentionMemory] = kinds.attention  # the lead attention group
        self.recurrent: Optional[RecurrentMemory] = kinds.recurrent
        self.kinds: list[LayerMemory] = kinds.all  # those that can refuse for lack of a slot first
        # the kinds whose pools change per token (a recurrent state is written in place): the
        # per-step verbs (here and in decode_rows.py) skip the others, whose allocate and commit do nothing
        self.allocating_kinds = [k for k in self.kinds if type(k).allocate is not LayerMemory.allocate]
        self.committing_kinds = [k for k in self.kinds if type(k).commit is not LayerMemory.commit]
        self.commit_checking_kinds = [k for k in self.committing_kinds if not k.decode_commit_always_idle]
        # every pool's writes from the host, done layer by layer in the step's forward (layer_loads.py)
        self.loads = LayerLoads(device)
        for pool in [g.pool for g in self.attention_groups.values()] + ([self.recurrent.states] if self.recurrent else []):
            pool.loads = self.loads
        self._reqs: dict[Hashable, Request] = {}
        self.disk: Optional[DiskTier] = None  # KV and states in files that outlive the process
        if disk_cache_dir is not None and enable_prefix_caching:
            self.disk = DiskTier(kinds, block_size, disk_cache_dir, disk_cache_bytes, fingerprint,
                                 read_ahead_bytes=DEFAULT_READ_AHEAD_BYTES if disk_read_ahead else 0)
        self.prefix_cache = PrefixCache(kinds, block_size, self._reqs,
                                        CheckpointPolicy(checkpoint_policy, block_size, checkpoint_every_n,
                                                         trail=HOST_TIER_TRAIL if host_cache_bytes else 0),
                                        enabled=enable_prefix_caching, fingerprint=fingerprint, disk=self.disk)
        self.drafts = DraftRuns(self)  # speculative decoding's verbs (draft_runs.py)
        self.preemptions = {"recompute": 0, "swap": 0}  # requests preempted, by mode

    @classmethod
    def from_budget(cls, specs: Mapping[int, LayerSpec], budget_bytes: int, block_size: int = 16,
                    max_num_seqs: int = 256, checkpoint_share: Optional[float] = None,
                    **kwargs) -> "HybridCacheManager":
        """Size the pools with `plan()`; checkpoint_share defaults to 0.1 (0 with policy 'none'
        or prefix caching off). Other keyword arguments go to the constructor."""
        if checkpoint_share is None:
            checkpoint_share = 0.0 if kwargs.get("checkpoint_policy", DEFAULT_POLICY) == "none" \
                or not kwargs.get("enable_prefix_caching", True) else 0.1
        p = plan(specs, budget_bytes, block_size, max_num_seqs, checkpoint_share,
                 max_chunk_tokens=kwargs.get("max_num_batched_tokens"), draft_slots=kwargs.pop("draft_slots", 0))
        mgr = cls(specs, block_size, p.group_blocks or p.num_blocks, p.num_slots, draft_slots=p.draft_slots, **kwargs)
        mgr.memory_plan = p
        return mgr

    # ---- pools -----------------------------------------------------------------------------
    @property
    def kv_caches(self) -> dict[int, torch.Tensor]:
        """{attention layer: [num_blocks, parts, block_size, kv_heads, head_dim]} (parts: AttentionSpec.kv_parts;
        num_blocks: the layer's group's). Like conv_states and ssm_states, read outside a step: the
        pending loads are done first (the model runner reads them through layer_loads.LoadedLayers)."""
        self.loads.settle()
        kv: dict[int, torch.Tensor] = {}
        for group in self.attention_groups.values():
            kv.update(group.pool.kv)
        return dict(sorted(kv.items()))

    @property
    def conv_states(self) -> dict[int, torch.Tensor]:
        """{recurrent layer: [num_slots, *conv_shape]} (layers without a conv window are absent)"""
        self.loads.settle()
        return self.recurrent.states.conv if self.recurrent else {}

    @property
    def ssm_states(self) -> dict[int, torch.Tensor]:
        """{recurrent layer: [num_slots, *state_shape]} (short-conv layers are absent)"""
        self.loads.settle()
        return self.recurrent.states.ssm if self.recurrent else {}

    @property
    def num_blocks(self) -> int:
        """Blocks of the lead attention group's pool (see attention_groups for the others)."""
        return self.attention.num_blocks if self.attention else 0

    @property
    def num_slots(self) -> int:
        return self.recurrent.num_slots if self.recurrent else 0

    @property
    def host(self):
        """The host tier of state checkpoints (memory/host_tier.py), which also holds swapped
        requests' bytes; None without one."""
        return self.recurrent.host if self.recurrent is not None else None

    @property
    def requests(self) -> Mapping[Hashable, Request]:
        return types.MappingProxyType(self._reqs)

    def request(self, req_id: Hashable) -> Request:
        try:
            return self._reqs[req_id]
        except KeyError:
            raise RequestStateError(f"unknown request id {req_id!r}") from None

    def live_slot(self, req_id: Hashable) -> int:
        """The request's state slot in every recurrent layer's pool (0 for pure-attention models)."""
        return self.recurrent.live_slot(req_id) if self.recurrent else 0

    def live_slots(self, req_ids: Sequence[Hashable]) -> list[int]:
        """live_slot of each request, in one call."""
        return self.recurrent.live_slots(req_ids) if self.recurrent else [0] * len(req_ids)

    def block_ids(self, req_id: Hashable) -> list[int]:
        """The request's KV block per table position (-1 where a block left the window)."""
        return self.attention.block_ids(req_id) if self.attention else []

    def running(self, req_id: Hashable) -> Request:
        """The request, which must be RUNNING (else RequestStateError)."""
        r = self.request(req_id)
        if r.status is not RUNNING:
            raise RequestStateError(f"request {req_id!r} is {r.status}, not running")
        return r

    # ---- admission -------------------------------------------------------------------------
    def check_fits(self, num_tokens: int, max_tokens: int = 0) -> None:
        """Raise RequestTooLargeError if a request of this size can never fit, whatever finishes."""
        if num_tokens < 1:
            raise RequestTooLargeError(f"a request needs at least one token; got {num_tokens}")
        for kind in self.kinds:
            why = kind.never_fits(num_tokens + max_tokens)
            if why:
                raise RequestTooLargeError(
                    f"request of {num_tokens} prompt + {max_tokens} max_tokens {why}: shorten the prompt "
                    f"or max_tokens, or raise the memory budget")

    def can_admit(self, request: Request, num_new_tokens: Optional[int] = None) -> bool:
        """Whether admit() would succeed now (it may extend request.block_hashes). Raises
        RequestTooLargeError if it never could."""
        self.check_fits(len(request.token_ids), request.max_tokens)
        return self._start(self.prefix_cache.keyed(request), num_new_tokens, dry_run=True) is not None

    def admit(self, request: Request, num_new_tokens: Optional[int] = None) -> Optional[int]:
        """Register and start a request the manager does not know: prefix match over every kind,
        then each kind takes its share (references on hit blocks, a live slot filled from the
        hit's checkpoint); the request becomes RUNNING at the hit. Returns the hit length in
        tokens, or None when the pools cannot take it now (nothing changed)."""
        rid = request.request_id
        if rid in self._reqs:
            raise RequestStateError(f"request id {rid!r} is already known to the manager")
        self.check_fits(len(request.token_ids), request.max_tokens)
        hit = self._start(self.prefix_cache.keyed(request), num_new_tokens)
        if hit is not None:
            self._reqs[rid] = request
        return hit

    def _start(self, r: Request, num_new_tokens: Optional[int], dry_run: bool = False) -> Optional[int]:
        def fits(match) -> bool:  # every kind can admit r at match with its first chunk now (no further than its tokens)
            end = len(r.token_ids) if num_new_tokens is None else \
                min(len(r.token_ids), match.blocks * self.block_size + num_new_tokens)
            return all(k.can_admit(r.block_hashes, match.blocks, end) for k in self.kinds)
        match = self.prefix_cache.match(r) if dry_run else self.prefix_cache.deepest_match(r, fits)
        if not fits(match):
            return None
        m, hit = match.blocks, match.blocks * self.block_size
        if dry_run:
            return hit
        for kind in self.kinds:
            kind.admit(r.request_id, r.block_hashes, m)
        r.num_computed_tokens, r.status = hit, RUNNING
        self.prefix_cache.admitted(r, match)
        return hit

    # ---- the step --------------------------------------------------------------------------
    def append_tokens(self, req_id: Hashable, token_ids: Sequence[int]) -> None:
        """Add sampled tokens to the request's token list (they are computed by later steps)."""
        self._reqs[req_id].token_ids.extend(token_ids)

    def allocate(self, req_id: Hashable, num_new_tokens: int) -> Optional[list[int]]:
        """KV write slots (`block * block_size + pos % block_size`) for positions [num_computed,
        num_computed + num_new_tokens); blocks are added (or a shared partial block copied) as
        needed. None when a pool cannot supply them; then nothing changed."""
        r = self._reqs[req_id]
        if r.status is not RUNNING:
            raise RequestStateError(f"request {req_id!r} is {r.status}; resume it before allocating")
        if num_new_tokens <= 0:
            return []
        start = r.num_computed_tokens
        end = start + num_new_tokens
        kinds = self.allocating_kinds
        for kind in kinds:
            if not kind.can_allocate(req_id, start, end):
                return None
        for kind in kinds:
            kind.allocate(req_id, start, end)
        if self.attention is None:
            return [-1] * num_new_tokens
        return self.attention.slot_mapping(req_id, start, end)

    def decode_rows(self, requests: Sequence[Request]) -> DecodeRows:
        """The handle of the batched one-token verbs for these running requests, in this order
        (decode_rows.py: valid while they run and get blocks only through its `allocate`)."""
        req_ids = [r.request_id for r in requests]
        for rid in req_ids:
            self.running(rid)
        return DecodeRows.of(self, req_ids, list(requests), self.live_slots(req_ids))

    def commit(self, req_id: Hashable, num_new_tokens: int) -> None:
        """The model computed `num_new_tokens` more tokens: advance num_computed_tokens, hash
        blocks that became full into the prefix cache, let blocks that left a window go."""
        r = self._reqs[req_id]
        new = r.num_computed_tokens + num_new_tokens
        held = len(self.attention.block_ids(req_id)) * self.block_size if self.attention else new
        if new > len(r.token_ids) or new > held:
            raise RequestStateError(
                f"commit of {num_new_tokens} tokens for {req_id!r} reaches {new}, past its "
                f"{len(r.token_ids)} known tokens or {held} allocated token slots: allocate() first")
        self.advance(req_id, r, new)
        if new >= r.num_prompt_tokens:  # its prompt is computed: no follower can wait for it now
            self.prefix_cache.bursts.drop(req_id)

    def advance(self, req_id: Hashable, r: Request, new: int) -> None:
        """commit() past its checks (the caller made them): num_computed_tokens becomes `new`,
        full blocks get hashed."""
        failed = self.advance_each([req_id], [r], [0], [new])
        if failed:
            raise failed[0]

    def advance_each(self, req_ids: list, states: list[Request], rows: list[int], new: list[int]
                     ) -> dict[int, Exception]:
        """advance() of requests `rows` (indices into req_ids and states, in this order) to new[i]
        tokens, in one loop (a decode step's tokens that fill blocks); {row: error} of those
        that raised, each left at the tokens it had."""
        kinds, hash_blocks, failed = self.committing_kinds, self.prefix_cache.hash_blocks, {}
        for i in rows:
            r, n = states[i], new[i]
            before = r.num_computed_tokens
            try:
                r.num_computed_tokens = n
                hashed = r.num_hashed_blocks
                full = hash_blocks(r, n)
                for kind in kinds:
                    kind.commit(req_ids[i], r.block_hashes, hashed, full, n)
                r.num_hashed_blocks = full
            except Exception as e:
                r.num_computed_tokens = before
                failed[i] = e
        return failed

    def block_table(self, req_ids: Sequence[Hashable], width: Optional[int] = None) -> torch.Tensor:
        """int32 `[len(req_ids), width]` (CPU) of block ids of running requests; width defaults to
        the longest table."""
        if self.attention is None:
            return torch.zeros(len(req_ids), max(1, width or 1), dtype=torch.int32)
        return self.attention.block_table(req_ids, width)

    def block_tables(self, req_ids: Sequence[Hashable]) -> dict[Optional[int], torch.Tensor]:
        """{window (None: full attention): int32 `[len(req_ids), width]` (CPU)}, one table per
        attention group, each as wide as its longest row; {} without attention layers."""
        return {w: group.block_table(req_ids) for w, group in self.attention_groups.items()}

    # ---- a request's life: fork, finish, preempt, resume, migrate ----------------------------
    def fork(self, parent_id: Hashable, child: Request) -> bool:
        """Start `child` (a request the manager does not know, its tokens equal to the parent's
        now: `parent.fork(...)`) as a copy of a running parent: blocks shared (a partial one
        copied on first write), state copied. False if a kind cannot take it now."""
        p = self.running(parent_id)
        child_id = child.request_id
        if child_id in self._reqs:
            raise RequestStateError(f"request id {child_id!r} is already known to the manager")
        if child.token_ids != p.token_ids:
            raise RequestStateError(f"fork {child_id!r}: its token_ids differ from parent {parent_id!r}'s")
        if not all(k.can_fork() for k in self.kinds):
            return False
        for kind in self.kinds:
            kind.fork(parent_id, child_id, p.num_computed_tokens)
        child.extra_key, child.block_hashes = p.extra_key, list(p.block_hashes)
        child.num_computed_tokens, child.num_hashed_blocks = p.num_computed_tokens, p.num_hashed_blocks
        child.status = RUNNING
        self._reqs[child_id] = child
        return True

    def finish(self, req_id: Hashable, discard: bool = False) -> None:
        """The request ends, whatever its status: every kind releases its memory (full blocks
        stay cached; the state stays as a checkpoint when the policy keeps final states and it
        ends at a block boundary), then forgets it; the manager drops it. discard: its memory may
        have run past num_computed_tokens (its step failed): nothing of that run is kept — no state
        becomes a checkpoint, and only the blocks hashed before (complete, committed) stay findable."""
        r = self.request(req_id)
        if r.status is RUNNING:
            donate = None if discard else self.prefix_cache.leaving_state(r, ending=True)
            for kind in self.kinds:
                kind.release(req_id, donate)
        for kind in self.kinds:
            kind.forget(req_id)
        self.prefix_cache.bursts.drop(req_id)
        swap.drop(r, self.host)
        r.shared.clear()
        del self._reqs[req_id]

    def preempt(self, req_id: Hashable, mode: str = "recompute") -> str:
        """recompute: every kind lets go (the state at the last block boundary is kept as a
        checkpoint); resume() re-matches the prefix. swap: every kind copies to host, then lets go;
        with a host tier its budget must hold the copy (memory/host_tier.py), else the request is
        preempted by recompute (swap.py). Returns the mode used."""
        r = self.running(req_id)
        if mode not in ("recompute", "swap"):
            raise ValueError(f"preemption mode {mode!r}; choose 'recompute' or 'swap'")
        if mode == "recompute" or not swap.swap_out(r, self.kinds, self.host):
            mode = "recompute"
            donate = self.prefix_cache.leaving_state(r)
            for kind in self.kinds:
                kind.release(req_id, donate)
            r.num_computed_tokens = r.num_hashed_blocks = 0
            r.shared.clear()
            r.status = WAITING
        self.prefix_cache.bursts.drop(req_id)
        self.preemptions[mode] += 1
        return mode

    def close(self) -> None:
        """Stop the disk tier's reader, finish its queued writes and stop its writer (nothing to do
        without one)."""
        if self.disk is not None:
            self.disk.close()

    def resume(self, req_id: Hashable, num_new_tokens: Optional[int] = None) -> Optional[int]:
        """Restart a preempted request; returns its num_computed_tokens, or None if it cannot run now."""
        r = self.request(req_id)
        if r.status is WAITING:
            return self._start(r, num_new_tokens)
        if r.status is not SWAPPED:
            raise RequestStateError(f"request {req_id!r} is {r.status}, not preempted")
        return swap.swap_in(r, self.kinds, r.block_hashes if self.prefix_cache.enabled else [], num_new_tokens, self.host)

    def export_snapshot(self, req_id: Hashable, device: torch.device | str = "cpu",
                        sampling_state=None) -> RequestSnapshot:
        """Copy a running request's memory of [0, num_computed_tokens) (KV, or the window of it,
        and the live state) to `device`."""
        return snapshot_transfer.export_snapshot(self.running(req_id), self.kinds, self.fingerprint,
                                                 self.block_size, device, sampling_state)

    def import_snapshot(self, snap: RequestSnapshot, request: Request,
                        num_new_tokens: Optional[int] = None) -> bool:
        """Continue an exported request here (any block size) as `request` (made from the snapshot:
        `snapshot_transfer.request_of`; its tokens equal snap.token_ids), which becomes RUNNING at
        snap.num_computed_tokens. False if the pools cannot take it now; SnapshotMismatchError if
        it was taken on another model or is malformed (checked before anything is allocated;
        nothing changes). A transaction: when a kind fails while placing its part, every kind lets
        go of what it took and the error is raised with nothing held."""
        snapshot_transfer.check_snapshot(snap, request, self.kinds, self.fingerprint, self.check_fits)
        rid = request.request_id
        if rid in self._reqs:
            raise RequestStateError(f"request id {rid!r} is already known to the manager")
        if not snapshot_transfer.place_snapshot(snap, request, self.kinds, self.prefix_cache, num_new_tokens):
            return False
        self._reqs[rid] = request
        return True

    def stats(self) -> ManagerStats:
        return ManagerStats.of(self)
