"""Admission: whether a request can ever fit, whether it fits now, and starting it on a prefix hit.

A mixin of HybridCacheManager (kept apart so each file holds one concept). Starting a request
takes references on the matched KV blocks and one live slot filled from the hit's checkpoint
(copy-on-hit; checkpoints never change). Also used to resume a request preempted by recompute.
"""
from __future__ import annotations

from typing import Hashable, Optional, Sequence

from hybridkv.errors import RequestStateError, RequestTooLargeError
from hybridkv.prefix_cache import MISS_CACHING_OFF, PrefixMatch, extend_hashes, extra_key
from hybridkv.request_state import RUNNING, RequestState
from hybridkv.state_pool import LIVE


class AdmissionMixin:
    def check_fits(self, num_tokens: int, max_tokens: int = 0) -> None:
        """Raise RequestTooLargeError if a request of this size can never fit, whatever finishes."""
        if num_tokens < 1:
            raise RequestTooLargeError(f"a request needs at least one token; got {num_tokens}")
        if self.has_attention:
            need = -(-(num_tokens + max_tokens) // self.block_size)
            if need > self.num_blocks:
                raise RequestTooLargeError(
                    f"request needs {need} KV blocks ({num_tokens} prompt + {max_tokens} max_tokens at "
                    f"block_size {self.block_size}) but the pool has {self.num_blocks}: shorten the prompt or "
                    f"max_tokens, or raise the memory budget")

    def can_admit(self, token_ids: Sequence[int], *, max_tokens: int = 0, cache_salt: Optional[str] = None,
                  adapter_id=None, mm_hashes: Sequence[str] = (), num_new_tokens: Optional[int] = None) -> bool:
        """Whether admit() would succeed now. Raises RequestTooLargeError if it never could."""
        r = self._new_state(None, token_ids, max_tokens, cache_salt, adapter_id, mm_hashes)
        return self._start(r, num_new_tokens, dry_run=True) is not None

    def admit(self, req_id: Hashable, token_ids: Sequence[int], *, max_tokens: int = 0,
              cache_salt: Optional[str] = None, adapter_id=None, mm_hashes: Sequence[str] = (),
              num_new_tokens: Optional[int] = None) -> Optional[int]:
        """Register and start a request: prefix match, one live slot (filled from the hit's
        checkpoint), references on the hit blocks. Returns the hit length in tokens, or None when
        the pools cannot take it now (nothing changed)."""
        if req_id in self._reqs:
            raise RequestStateError(f"request id {req_id!r} is already known to the manager")
        r = self._new_state(req_id, token_ids, max_tokens, cache_salt, adapter_id, mm_hashes)
        hit = self._start(r, num_new_tokens)
        if hit is not None:
            self._reqs[req_id] = r
        return hit

    def _new_state(self, req_id, token_ids, max_tokens, cache_salt, adapter_id, mm_hashes) -> RequestState:
        self.check_fits(len(token_ids), max_tokens)
        key = extra_key(self.fingerprint, adapter_id, tuple(mm_hashes), cache_salt)
        tokens = token_ids if isinstance(token_ids, list) else list(token_ids)  # the owner's list, not a copy
        return RequestState(req_id, tokens, len(token_ids), max_tokens, key, cache_salt, adapter_id,
                            tuple(mm_hashes))

    def _start(self, r: RequestState, num_new_tokens: Optional[int], dry_run: bool = False) -> Optional[int]:
        bs, n_tok = self.block_size, len(r.token_ids)
        if self.enable_prefix_caching:
            extend_hashes(r.block_hashes, r.token_ids, n_tok // bs, r.extra_key, bs)
            m = self.prefix.match(r.block_hashes, n_tok)
        else:
            m = PrefixMatch(miss=MISS_CACHING_OFF)
        hit = m.hit_tokens
        n_new = n_tok - hit if num_new_tokens is None else num_new_tokens
        revived = sum(1 for b in m.blocks if self.blocks.refcount[b] == 0)
        if self.has_attention and self.blocks.num_free - revived < -(-n_new // bs):
            return None
        if self.has_recurrent and self.states.num_free == 0 and not self.prefix.checkpoints:
            return None
        if dry_run:
            return hit
        if self.has_recurrent:
            r.slot = self._live_slot_from(m, r.block_hashes)
        self.blocks.ref(m.blocks)
        r.block_ids = list(m.blocks)
        if self.has_attention:
            r.row = self.tables.new_row()
            self.tables.write(r.row, 0, r.block_ids)
        r.num_computed_tokens, r.num_hashed_blocks = hit, hit // bs
        # Only a real junction (another cached continuation), not the end of a cached sequence.
        r.branch_point = m.kv_match_tokens if m.kv_match_tokens > hit and m.branches else None
        r.status = RUNNING
        self._queries += 1
        self._query_tokens += n_tok
        self._hit_tokens += hit
        if m.miss:
            self._misses[m.miss] += 1
        return hit

    def _live_slot_from(self, m: PrefixMatch, hashes: list[bytes]) -> int:
        """A live slot holding the state at the hit (copy of its checkpoint), or a fresh slot."""
        key = hashes[m.hit_tokens // self.block_size - 1] if m.checkpoint else None
        slot = self.prefix.take_slot(LIVE, protect=key)
        if m.checkpoint is None:
            return slot
        if slot is None:  # the hit's checkpoint is the only slot left: it becomes the live slot
            del self.prefix.checkpoints[key]
            self.states.mark(m.checkpoint.slot, LIVE)
            return m.checkpoint.slot
        self.prefix.touch(key)
        self.states.copy(m.checkpoint.slot, slot)
        return slot

