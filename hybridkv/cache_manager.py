"""HybridCacheManager: the one object the scheduler talks to about memory.

It holds a paged KV pool (`BlockPool`) for attention layers and a whole-object state pool
(`StatePool`) for recurrent layers, a prefix cache over both, and per request a block table,
`num_computed_tokens`, one live slot and the token ids known so far. Invariant at every step
boundary: the live slot holds the state after exactly `num_computed_tokens` tokens, and the
block table covers `[0, num_computed_tokens)`.

Scheduler-facing API (request ids are any hashable; "not now" is None/False, never an exception;
a request that can never fit raises RequestTooLargeError, a ValueError):

    mgr = HybridCacheManager(specs, block_size, num_blocks, num_slots, device=..., ...)
    mgr = HybridCacheManager.from_budget(specs, budget_bytes, block_size, max_num_seqs, checkpoint_share, ...)
    mgr.kv_caches / mgr.conv_states / mgr.ssm_states      {layer_idx: tensor} for ModelCaches
    mgr.check_fits(num_prompt_tokens, max_tokens)          raises RequestTooLargeError
    mgr.can_admit(token_ids, max_tokens=, cache_salt=, ..., num_new_tokens=None) -> bool
    mgr.admit(req_id, token_ids, max_tokens=, cache_salt=, adapter_id=, mm_hashes=, num_new_tokens=None)
        -> hit tokens (int, block-aligned, < len(token_ids)) or None (does not fit now; no side effect).
        On success allocate(req_id, n) for n <= num_new_tokens (default: all uncomputed tokens)
        is guaranteed to succeed right after.
    mgr.append_tokens(req_id, token_ids)                   sampled tokens, before they are computed
    mgr.allocate(req_id, n) -> list[int] | None            flat KV write slots for positions
        [num_computed, num_computed + n) (-1 each for models without attention); None = not enough
        blocks even after evicting cached blocks (no side effect): preempt someone and retry.
    mgr.commit(req_id, n)                                   the step ran: num_computed += n, newly
        full blocks are hashed into the prefix cache
    mgr.checkpoint_due(req_id, start, end) -> int | None    block boundary in (start, end] where the
        policy wants a checkpoint: cut the chunk there, commit, then call mgr.checkpoint(req_id)
    mgr.checkpoint(req_id) -> bool                          live slot -> checkpoint slot at num_computed
    mgr.fork(parent_id, child_id) -> bool                   share blocks, copy the slot (n > 1, beams)
    mgr.preempt(req_id, mode="recompute" | "swap")
    mgr.resume(req_id, num_new_tokens=None) -> int | None   num_computed after resume, or None
    mgr.finish(req_id)
    mgr.export_snapshot(req_id, device="cpu", sampling_state=None) -> RequestSnapshot
    mgr.import_snapshot(snapshot, req_id=None, num_new_tokens=None) -> bool
    mgr.block_table(req_ids, width=None) -> int32 [R, width];  mgr.live_slot(req_id) -> int
    mgr.request(req_id) -> RequestState (read-only view);  mgr.stats() -> ManagerStats

A step: for each scheduled request `slots = allocate(r, n)` (None -> preempt a victim, retry),
run the model with `block_table(...)`, the slot mappings and `live_slot(r)` for each request
(has_initial_state = num_computed > 0), then `commit(r, n)` and, where a checkpoint was due,
`checkpoint(r)`. Eviction is internal: free cached blocks go LRU-first when blocks are short;
checkpoints go (unreachable first, then LRU or FLOP-aware) when slots are short.
"""
from __future__ import annotations

import types
from typing import Hashable, Mapping, Optional, Sequence

import torch

from hybridkv.block_pool import BlockPool
from hybridkv.block_table import BlockTables
from hybridkv.checkpoint_policy import DEFAULT_POLICY, CheckpointPolicy
from hybridkv.errors import MemoryBudgetError, RequestStateError
from hybridkv.manager_stats import ManagerStats
from hybridkv.plan import plan, split_specs
from hybridkv.prefix_cache import MISS_CACHING_OFF, PrefixCache, extend_hashes
from hybridkv.request_state import RUNNING, RequestState
from hybridkv.specs import LayerSpec
from hybridkv.state_pool import CHECKPOINT, LIVE, StatePool
from hybridkv.admission import AdmissionMixin
from hybridkv.lifecycle import LifecycleMixin
from hybridkv.transfer import TransferMixin


class HybridCacheManager(AdmissionMixin, LifecycleMixin, TransferMixin):
    """Dual memory manager; see the module docstring for the scheduler-facing contract."""

    def __init__(self, specs: Mapping[int, LayerSpec], block_size: int = 16, num_blocks: int = 0,
                 num_slots: int = 0, *, device: torch.device | str = "cpu", enable_prefix_caching: bool = True,
                 checkpoint_policy: str = DEFAULT_POLICY, checkpoint_every_n: int = 4,
                 checkpoint_eviction: str = "lru", fingerprint: str = "",
                 flops_per_token: Optional[float] = None):
        attn, rec = split_specs(specs)
        if not isinstance(block_size, int) or block_size <= 0:
            raise MemoryBudgetError(f"block_size={block_size!r} must be a positive integer (e.g. 16)")
        if attn and num_blocks < 1:
            raise MemoryBudgetError(f"num_blocks={num_blocks}: a model with attention layers needs >= 1 KV block")
        if rec and num_slots < 2:
            raise MemoryBudgetError(
                f"num_slots={num_slots}: a model with recurrent layers needs >= 2 slots (null slot 0 + one live)")
        if not attn and not rec:
            raise MemoryBudgetError("specs are empty: the model declares no attention and no recurrent layer")
        self.specs = dict(specs)
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.has_attention, self.has_recurrent = bool(attn), bool(rec)
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = BlockPool(attn, num_blocks, block_size, device)
        self.states = StatePool(rec, num_slots, device)
        self.policy = CheckpointPolicy(checkpoint_policy, block_size, checkpoint_every_n)
        # Prefill FLOPs saved by a checkpoint at p: linear part plus attention's p^2 term.
        quad = 4.0 * sum(s.num_kv_heads * s.head_dim for s in attn.values())
        lin = float(flops_per_token) if flops_per_token else 0.0
        self.prefix = PrefixCache(self.blocks, self.states, block_size, has_attention=self.has_attention,
                                  has_recurrent=self.has_recurrent, eviction=checkpoint_eviction,
                                  saved_flops=lambda p: lin * p + quad * p * p + p)
        self.tables = BlockTables()
        self._reqs: dict[Hashable, RequestState] = {}
        self._hit_tokens = self._query_tokens = self._queries = 0
        self._misses = {"no_kv_match": 0, "kv_match_no_checkpoint": 0, MISS_CACHING_OFF: 0}
        self._preemptions = {"recompute": 0, "swap": 0}

    @classmethod
    def from_budget(cls, specs: Mapping[int, LayerSpec], budget_bytes: int, block_size: int = 16,
                    max_num_seqs: int = 256, checkpoint_share: Optional[float] = None,
                    **kwargs) -> "HybridCacheManager":
        """Size the pools with `plan()`; checkpoint_share defaults to 0.1 (0 with policy 'none'
        or prefix caching off). Other keyword arguments go to the constructor."""
        if checkpoint_share is None:
            off = kwargs.get("checkpoint_policy", DEFAULT_POLICY) == "none" or not kwargs.get("enable_prefix_caching", True)
            checkpoint_share = 0.0 if off else 0.1
        p = plan(specs, budget_bytes, block_size, max_num_seqs, checkpoint_share)
        mgr = cls(specs, block_size, p.num_blocks, p.num_slots, **kwargs)
        mgr.memory_plan = p
        return mgr

    # ---- pools -----------------------------------------------------------------------------
    @property
    def kv_caches(self) -> dict[int, torch.Tensor]:
        """{attention layer: [num_blocks, 2, block_size, kv_heads, head_dim]}"""
        return self.blocks.kv

    @property
    def conv_states(self) -> dict[int, torch.Tensor]:
        """{recurrent layer: [num_slots, *conv_shape]} (layers without a conv window are absent)"""
        return self.states.conv

    @property
    def ssm_states(self) -> dict[int, torch.Tensor]:
        """{recurrent layer: [num_slots, *state_shape]} (short-conv layers are absent)"""
        return self.states.ssm

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def num_slots(self) -> int:
        return self.states.num_slots

    @property
    def requests(self) -> Mapping[Hashable, RequestState]:
        return types.MappingProxyType(self._reqs)

    def request(self, req_id: Hashable) -> RequestState:
        try:
            return self._reqs[req_id]
        except KeyError:
            raise RequestStateError(f"unknown request id {req_id!r}") from None

    def live_slot(self, req_id: Hashable) -> int:
        """The request's state slot in every recurrent layer's pool (0 for pure-attention models)."""
        return self._reqs[req_id].slot

    # ---- the step --------------------------------------------------------------------------
    def append_tokens(self, req_id: Hashable, token_ids: Sequence[int]) -> None:
        """Add sampled tokens to the request's known tokens (they are computed by later steps)."""
        self._reqs[req_id].token_ids.extend(token_ids)

    def allocate(self, req_id: Hashable, num_new_tokens: int) -> Optional[list[int]]:
        """KV write slots (`block * block_size + pos % block_size`) for positions [num_computed,
        num_computed + num_new_tokens); blocks are added (or a shared partial block copied) as
        needed. None when the pool cannot supply them; then nothing changed."""
        r = self._reqs[req_id]
        if r.status is not RUNNING:
            raise RequestStateError(f"request {req_id!r} is {r.status}; resume it before allocating")
        if not self.has_attention:
            return [-1] * num_new_tokens
        bs, blocks = self.block_size, r.block_ids
        start = r.num_computed_tokens
        end = start + num_new_tokens
        if num_new_tokens <= 0:
            return []
        if end > len(blocks) * bs or (start % bs and self.blocks.refcount[blocks[start // bs]] > 1):
            if not self._grow(r, start, end):
                return None
        if num_new_tokens == 1:
            return [blocks[start // bs] * bs + start % bs]
        return [blocks[p // bs] * bs + p % bs for p in range(start, end)]

    def _grow(self, r: RequestState, start: int, end: int) -> bool:
        bs, blocks, pool = self.block_size, r.block_ids, self.blocks
        need = max(0, -(-end // bs) - len(blocks))
        cow = bool(start % bs) and pool.refcount[blocks[start // bs]] > 1
        new = pool.allocate(need + cow)
        if new is None:
            return False
        if cow:  # never write a shared block: give this request its own copy of the partial block
            i, fresh = start // bs, new.pop()
            pool.copy_block(blocks[i], fresh)
            pool.release([blocks[i]])
            blocks[i] = fresh
            self.tables.write(r.row, i, [fresh])
        if new:
            self.tables.write(r.row, len(blocks), new)
            blocks.extend(new)
        return True

    def commit(self, req_id: Hashable, num_new_tokens: int) -> None:
        """The model computed `num_new_tokens` more tokens: advance num_computed_tokens and hash
        blocks that became full into the prefix cache."""
        r = self._reqs[req_id]
        new = r.num_computed_tokens + num_new_tokens
        if new > len(r.token_ids) or (self.has_attention and new > len(r.block_ids) * self.block_size):
            raise RequestStateError(
                f"commit of {num_new_tokens} tokens for {req_id!r} reaches {new}, past its "
                f"{len(r.token_ids)} known tokens or {len(r.block_ids)} allocated blocks: allocate() first")
        r.num_computed_tokens = new
        if self.enable_prefix_caching and new // self.block_size > r.num_hashed_blocks:
            self._hash_full_blocks(r)

    def _hash_full_blocks(self, r: RequestState) -> None:
        full = r.num_computed_tokens // self.block_size
        extend_hashes(r.block_hashes, r.token_ids, full, r.extra_key, self.block_size)
        if self.has_attention:
            for i in range(r.num_hashed_blocks, full):
                parent = r.block_hashes[i - 1] if i else b""
                self.blocks.set_hash(r.block_ids[i], r.block_hashes[i], parent)
        r.num_hashed_blocks = full

    def block_table(self, req_ids: Sequence[Hashable], width: Optional[int] = None) -> torch.Tensor:
        """int32 `[len(req_ids), width]` (CPU) of block ids; width defaults to the longest table."""
        reqs = [self._reqs[i] for i in req_ids]
        if not self.has_attention:
            return torch.zeros(len(reqs), max(1, width or 1), dtype=torch.int32)
        if width is None:
            width = max((len(r.block_ids) for r in reqs), default=1)
        return self.tables.gather([r.row for r in reqs], width)

    # ---- checkpoints -----------------------------------------------------------------------
    def checkpoint_due(self, req_id: Hashable, start: int, end: int) -> Optional[int]:
        """The first block boundary in (start, end] where the policy wants the state kept, else None."""
        if not (self.has_recurrent and self.enable_prefix_caching):
            return None
        r = self._reqs[req_id]
        return self.policy.due(start, end, r.num_prompt_tokens, r.branch_point)

    def checkpoint(self, req_id: Hashable) -> bool:
        """Copy the live slot into a checkpoint keyed by the hash of the block ending at
        num_computed_tokens (a block boundary). False if one exists already, caching is off, or
        no slot can be freed."""
        r = self._running(req_id)
        if not (self.has_recurrent and self.enable_prefix_caching):
            return False
        nc, bs = r.num_computed_tokens, self.block_size
        if nc == 0 or nc % bs:
            raise RequestStateError(
                f"checkpoint of {req_id!r} at num_computed_tokens={nc}, not a block boundary (block_size "
                f"{bs}): cut the chunk where checkpoint_due() says")
        h = self._boundary_hash(r)
        if nc <= r.num_prompt_tokens or not self.policy.rolling_output:
            return self.prefix.store(h, nc, r.slot)
        # A rolling checkpoint in the output replaces the request's previous one, and displaces
        # only other output states, never a prefix state that other requests share.
        old, r.rolling_checkpoint = r.rolling_checkpoint, h
        if old is not None and old != h and old in self.prefix.checkpoints:
            self.prefix.drop(old)
        return self.prefix.store(h, nc, r.slot, output=True)

    def _boundary_hash(self, r: RequestState) -> bytes:
        i = r.num_computed_tokens // self.block_size - 1
        if self.has_attention:  # re-register in case an evicted twin answered for this hash
            self.blocks.set_hash(r.block_ids[i], r.block_hashes[i])
        return r.block_hashes[i]

    # ---- bursts ----------------------------------------------------------------------------
    def waits_for_shared_prefix(self, req_id: Hashable, token_ids: Sequence[int], *,
                                cache_salt: Optional[str] = None) -> bool:
        """Whether a not-yet-admitted request should wait one step for a running request that is
        computing a prefix they share (burst rule). Placeholder until memory v2 lands: never."""
        return False

    # ---- statistics ------------------------------------------------------------------------
    def stats(self) -> ManagerStats:
        pool, st = self.blocks, self.states
        used = pool.num_blocks - pool.num_free
        running = [r for r in self._reqs.values() if r.status is RUNNING]
        waste = sum(len(r.block_ids) * self.block_size - r.num_computed_tokens for r in running if r.block_ids)
        return ManagerStats(
            kv_blocks_used=used, kv_blocks_cached=pool.num_cached_free, kv_blocks_free=pool.num_free,
            kv_blocks_total=pool.num_blocks, slots_live=st.count(LIVE), slots_checkpoint=st.count(CHECKPOINT),
            slots_free=st.num_free, slots_total=max(0, st.num_slots - 1), prefix_hit_tokens=self._hit_tokens,
            prefix_query_tokens=self._query_tokens, prefix_queries=self._queries, prefix_misses=dict(self._misses),
            preemptions=dict(self._preemptions),
            fragmentation=waste / (used * self.block_size) if used else 0.0, running_requests=len(running))
