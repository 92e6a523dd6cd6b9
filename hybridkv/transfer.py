"""Moving a request out of the pools and back: swap to host memory, and migrate as a snapshot.

A mixin of HybridCacheManager (kept apart so each file holds one concept); it uses the
manager's pools, tables and request states.
"""
from __future__ import annotations

from typing import Hashable, Optional

import torch

from hybridkv.errors import RequestStateError, SnapshotMismatchError
from hybridkv.prefix_cache import extend_hashes, extra_key
from hybridkv.request_state import RUNNING, RequestState
from hybridkv.snapshot import RequestSnapshot
from hybridkv.state_pool import LIVE
from hybridkv.swap import blocks_from_tokens, copy_in, copy_out, kv_tokens


class TransferMixin:
    # ---- swap ------------------------------------------------------------------------------
    def _swap_out(self, r: RequestState) -> None:
        n = -(-r.num_computed_tokens // self.block_size) if self.has_attention else 0
        r.swapped = copy_out(self.blocks, self.states, r.block_ids[:n], r.slot)
        self._release_blocks(r)
        if r.slot:
            self.states.free(r.slot)
            r.slot = 0

    def _swap_in(self, r: RequestState, num_new_tokens: Optional[int]) -> Optional[int]:
        copy = r.swapped
        if not self._reserve(r.num_computed_tokens, len(r.token_ids), num_new_tokens):
            return None
        self._place(r, copy_blocks=copy.num_blocks)
        copy_in(self.blocks, self.states, copy, r.block_ids, r.slot)
        self._rehash(r)
        r.swapped = None
        return r.num_computed_tokens

    def _reserve(self, num_computed: int, num_tokens: int, num_new_tokens: Optional[int]) -> bool:
        """Whether blocks for [0, num_computed + next tokens) and a slot are available now."""
        n_new = num_tokens - num_computed if num_new_tokens is None else num_new_tokens
        need = -(-(num_computed + n_new) // self.block_size) if self.has_attention else 0
        return self.blocks.num_free >= need and self._slot_available()

    def _place(self, r: RequestState, copy_blocks: int) -> None:
        """Give r `copy_blocks` fresh blocks, a table row and a live slot; mark it running."""
        if self.has_recurrent:
            r.slot = self.prefix.take_slot(LIVE)
        r.block_ids = self.blocks.allocate(copy_blocks) if self.has_attention else []
        if self.has_attention:
            r.row = self.tables.new_row()
            self.tables.write(r.row, 0, r.block_ids)
        r.status = RUNNING

    def _rehash(self, r: RequestState) -> None:
        """Make the request's full computed blocks findable by prefix again."""
        r.num_hashed_blocks = 0
        if self.enable_prefix_caching:
            self._hash_full_blocks(r)

    # ---- migrate ---------------------------------------------------------------------------
    def export_snapshot(self, req_id: Hashable, device: torch.device | str = "cpu",
                        sampling_state=None) -> RequestSnapshot:
        """Copy a running request's KV of [0, num_computed_tokens) and its live state to `device`."""
        r = self._running(req_id)
        n = -(-r.num_computed_tokens // self.block_size) if self.has_attention else 0
        kv = kv_tokens(self.blocks, r.block_ids[:n], r.num_computed_tokens, device)
        conv, ssm = self.states.to_host(r.slot, device) if r.slot else ({}, {})
        return RequestSnapshot(r.req_id, list(r.token_ids), r.num_prompt_tokens, r.num_computed_tokens,
                               r.max_tokens, kv, conv, ssm, self.fingerprint, self.block_size, r.cache_salt,
                               r.adapter_id, r.mm_hashes, sampling_state, self._layer_shapes())

    def import_snapshot(self, snap: RequestSnapshot, req_id: Optional[Hashable] = None,
                        num_new_tokens: Optional[int] = None, token_ids: Optional[list[int]] = None) -> bool:
        """Continue an exported request here (any block size). token_ids: the owner's list equal to
        snap.token_ids (None: the manager keeps a copy). False if the pools cannot take it now;
        SnapshotMismatchError if it was taken on another model."""
        if snap.fingerprint != self.fingerprint:
            raise SnapshotMismatchError(
                f"snapshot fingerprint {snap.fingerprint!r} != this model's {self.fingerprint!r}: a request "
                f"can only move between engines serving the same model and weights")
        mine = self._layer_shapes()
        if snap.layer_shapes != mine:
            raise SnapshotMismatchError(
                f"snapshot layers {snap.layer_shapes} differ from this model's {mine}: same fingerprint, "
                f"different layer specs; check the model config")
        rid = snap.req_id if req_id is None else req_id
        if rid in self._reqs:
            raise RequestStateError(f"request id {rid!r} is already known to the manager")
        self.check_fits(snap.num_prompt_tokens, snap.max_tokens)
        nc = snap.num_computed_tokens
        if not self._reserve(nc, len(snap.token_ids), num_new_tokens):
            return False
        key = extra_key(self.fingerprint, snap.adapter_id, tuple(snap.mm_hashes), snap.cache_salt)
        r = RequestState(rid, list(snap.token_ids) if token_ids is None else token_ids, snap.num_prompt_tokens, snap.max_tokens, key, snap.cache_salt,
                         snap.adapter_id, tuple(snap.mm_hashes), num_computed_tokens=nc)
        self._place(r, copy_blocks=-(-nc // self.block_size) if self.has_attention else 0)
        if r.block_ids:
            self.blocks.scatter(r.block_ids, blocks_from_tokens(snap.kv, self.block_size))
        if r.slot:
            self.states.from_host(r.slot, snap.conv, snap.ssm)
        if self.enable_prefix_caching:
            extend_hashes(r.block_hashes, r.token_ids, len(r.token_ids) // self.block_size, key, self.block_size)
        self._rehash(r)
        self._reqs[rid] = r
        return True

    def _layer_shapes(self) -> dict[int, tuple]:
        """{layer: per-token KV shape or (conv shape, state shape)} with dtypes, to refuse mismatched imports."""
        out = {}
        for i, s in self.specs.items():
            if hasattr(s, "num_kv_heads"):
                out[i] = ("attn", s.num_kv_heads, s.head_dim, str(s.dtype))
            else:
                out[i] = ("rec", tuple(s.conv_shape), tuple(s.state_shape), str(s.dtype), str(s.ssm_dtype))
        return out
