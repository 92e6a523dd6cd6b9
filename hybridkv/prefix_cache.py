"""The prefix cache: how a request's computed memory becomes findable by later requests, and how a
new request finds it (docs/design.md, "Prefix hits", "Checkpoint policy", "The burst rule").

A block is known by its chained hash under the request's key (block_hash.py: model fingerprint,
adapter, multimodal hashes, cache_salt). A committed full block's KV is findable once its hash is
given to each kind (`hash_blocks`); a recurrent state only where a checkpoint keeps it: the policy
says at which block boundary (`checkpoint_due`, checkpoint_policy.py), `checkpoint` / `store`
copy the state there, and a live state let go at a boundary can stay as one (`donation`). A hit
is usable only as far as every kind can resume it (prefix_match.py); the lower tiers (host KV and
states, disk) are seen through one rule of how deep they reach together (memory/tier_reach.py),
which the router's probe (`usable_tokens`) and admission (`deepest_match`) share. The burst rule
(memory/burst.py) holds a new request back a step for a running one computing the prefix they share;
the read-ahead rule (memory/disk_read_ahead.py) holds a waiting one while the disk files its hit
takes are read off the step (`waits_for_disk_read`), and its admission promotes from those bytes.

Owned by the HybridCacheManager (`mgr.prefix_cache`), whose verbs call it; it reads the manager's
requests by id and changes only their hash and checkpoint fields (extra_key, block_hashes,
num_hashed_blocks, resumed_from, branch_point, shared). The scheduler asks it where to cut a
chunk, to checkpoint, and about bursts; the data-parallel router asks `usable_tokens`; the
prefix-hit guard calls `invalidate`.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Hashable, Mapping, Optional, Sequence

from hybridkv.block_hash import extend_hashes, extra_key
from hybridkv.checkpoint_policy import CheckpointPolicy
from hybridkv.errors import RequestStateError
from hybridkv.memory.burst import BurstRule
from hybridkv.memory.disk_read_ahead import DiskReadAhead
from hybridkv.memory.disk_tier import DiskTier
from hybridkv.memory.full_attention import NO_BLOCK, FullAttentionMemory
from hybridkv.memory.kinds import ModelKinds
from hybridkv.memory.tier_reach import TierReach
from hybridkv.prefix_match import NO_MATCH, PrefixHitCounter, PrefixMatch, match_prefix
from hybridkv.request import Request, RequestStatus

RUNNING = RequestStatus.RUNNING


class PrefixCache:
    """enabled: prefix caching on (off: nothing is hashed, matched or checkpointed); requests: the
    manager's requests by id (read here, never added or removed)."""

    def __init__(self, kinds: ModelKinds, block_size: int, requests: Mapping[Hashable, Request],
                 policy: CheckpointPolicy, *, enabled: bool = True, fingerprint: str = "",
                 disk: Optional[DiskTier] = None):
        self.enabled = enabled
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.policy = policy
        self.kinds = kinds.all
        self.attention = kinds.attention  # the lead attention group
        self.recurrent = kinds.recurrent
        self._requests = requests
        self.hits = PrefixHitCounter()
        self.pinned_turns = 0  # turns that ended pinned (pin)
        self.disk = disk  # the disk tier (memory/disk_tier.py): KV and states in files that outlive the process
        self.host_kv = kinds.host_kv  # evicted KV blocks in host memory (memory/host_kv_tier.py)
        self.tiers = TierReach(kinds, block_size, disk)  # how deep device, host and disk reach together
        # without recurrent layers no checkpoint writes a prefix's KV through: each full block goes as it fills
        self._kv_write_through = disk is not None and kinds.recurrent is None
        self.read_ahead = DiskReadAhead(self.tiers, disk.reader, disk.counters) \
            if disk is not None and disk.reader is not None else None  # disk reads off the step
        self.bursts = BurstRule(block_size, self.prompt_hashes, lambda hashes, n: self._match(hashes, n).blocks)

    # ---- hashes ----------------------------------------------------------------------------
    def keyed(self, r: Request) -> Request:
        """`r` with its blocks' hash key (hashes made under another key are dropped)."""
        key = extra_key(self.fingerprint, r.adapter_id, r.mm_hashes, r.cache_salt)
        if key != r.extra_key:
            r.extra_key = key
            r.block_hashes.clear()
        return r

    def hashes(self, r: Request) -> list[bytes]:
        """r.block_hashes, extended to every full block of its token list."""
        extend_hashes(r.block_hashes, r.token_ids, len(r.token_ids) // self.block_size, r.extra_key,
                      self.block_size)
        return r.block_hashes

    def prompt_hashes(self, token_ids: Sequence[int], cache_salt: Optional[str]) -> list[bytes]:
        """The hashes of the full blocks strictly inside a prompt not yet admitted."""
        hashes: list[bytes] = []
        extend_hashes(hashes, token_ids, (len(token_ids) - 1) // self.block_size,
                      extra_key(self.fingerprint, None, (), cache_salt), self.block_size)
        return hashes

    def hash_blocks(self, r: Request, num_computed: int) -> int:
        """Hash r's blocks that are full at num_computed tokens (none with caching off); returns
        how many of its blocks are hashed then (never fewer than before). Called as they are
        committed, before a window lets any go: the disk tier of a model without states writes them."""
        full = num_computed // self.block_size if self.enabled else 0
        if full > r.num_hashed_blocks:
            extend_hashes(r.block_hashes, r.token_ids, full, r.extra_key, self.block_size)
            if self._kv_write_through:
                self.disk.write_blocks(r.request_id, r.block_hashes, r.num_hashed_blocks, full)
            return full
        return r.num_hashed_blocks

    # ---- lookup ----------------------------------------------------------------------------
    def match(self, r: Request) -> PrefixMatch:
        """The hit every kind accepts for r's tokens (NO_MATCH with caching off)."""
        return self._match(self.hashes(r), len(r.token_ids)) if self.enabled else NO_MATCH

    def deepest_match(self, r: Request, fits: Callable[[PrefixMatch], bool]) -> PrefixMatch:
        """match(r), deepened from the lower tiers when together they hold more of r's prefix:
        the deepest position whose every piece is on the device, the host or the disk (each piece
        from any of them, memory/tier_reach.py) is promoted into the device pools, then r is
        matched again (a lower-tier entry that fails its check is refused and a shallower position
        promoted). Disk files read ahead for r (waits_for_disk_read) are taken as read; what
        nothing staged is read here. The deeper hit is taken only when `fits` (every kind can take it and its
        first chunk now); else the shallower one, if the promotions left it usable."""
        match = self.match(r)
        if self.host_kv is None and self.disk is None or not self.enabled:
            return match
        limit = min((len(r.token_ids) - 1) // self.block_size, len(r.block_hashes))
        staged = self.read_ahead.take(r.request_id) if self.read_ahead is not None else None
        if not self.tiers.promote(r.block_hashes, limit, match.blocks, staged):
            return match
        deeper = self.match(r)
        if fits(deeper) or not all(k.usable_prefix(r.block_hashes, match.blocks) == match.blocks for k in self.kinds):
            return deeper
        return match

    def leaving_state(self, r: Request, ending: bool = False) -> Optional[tuple[bytes, int]]:
        """donation(r), written through to the disk tier when there is one (a restart finds it);
        `ending` (r finishes, not preempted): none unless the policy keeps final states, and a
        pinned turn's memory is pinned (pin) whatever the policy."""
        donate = self.donation(r) if not ending or self.policy.keeps_final_state else None
        if self.disk is not None and donate is not None:
            self.disk.write(r.request_id, r.block_hashes, donate[1], self.recurrent.live_slot(r.request_id))
        if ending:
            self.pin(r, donate)
        return donate

    def pin(self, r: Request, donate: Optional[tuple[bytes, int]]) -> None:
        """A pinned turn (r.params.cache_pin_ttl_s) about to end: its hashed KV blocks in every
        attention group, the device states kept at its block boundaries and the one it leaves
        (`donate`: the key its release keeps it under) stay findable for the TTL: eviction takes
        them only when nothing unpinned is left (a running request needs the memory)."""
        ttl = getattr(r.params, "cache_pin_ttl_s", None)
        if not ttl or not self.enabled:
            return
        until = time.monotonic() + ttl
        hashes, kv_pinned = r.block_hashes[:r.num_hashed_blocks], None  # (None: no attention, no KV to keep)
        for kind in self.kinds:
            if isinstance(kind, FullAttentionMemory):  # the block that answers each hash: r's own, or a twin's
                cached = kind.pool.cached  # when one answered first (r's then goes unhashed at release), or
                held = kind.block_ids(r.request_id)[:r.num_hashed_blocks]  # one r let go (it left the window)
                blocks = [cached.get(h, b) for h, b in zip(hashes, held)]
                kind.pool.pin([b for b in blocks if b != NO_BLOCK], until)
                if kind is self.attention:
                    kv_pinned = {h for h, b in zip(hashes, blocks) if b != NO_BLOCK}
        if self.recurrent is not None:  # every state kept at its blocks whose KV the lead group keeps pinned
            kept = [h for h in hashes if h in self.recurrent.checkpoints and (kv_pinned is None or h in kv_pinned)]
            for h in kept + ([donate[0]] if donate else []):  # (one whose KV went is dropped), and the one it leaves
                self.recurrent.pins.pin(h, until)  # kept now or by the release that follows
        self.pinned_turns += 1

    def _match(self, hashes: Sequence[bytes], num_tokens: int) -> PrefixMatch:
        """One token is always left to compute (prefix_match.py)."""
        return match_prefix(self.kinds, self.attention, hashes, num_tokens, self.block_size)

    def usable_tokens(self, token_ids: Sequence[int], cache_salt: Optional[str] = None) -> int:
        """Tokens of a prompt admitted now would take from cache under the hybrid hit rule (KV of
        every kind and a state checkpoint at the same position), each piece from any tier: what
        deepest_match would promote and hit, given intact entries and room (memory/tier_reach.py);
        block-aligned. Changes nothing (no stats, no LRU touch, no file read, no checksum): the
        data-parallel router asks every replica this."""
        if not self.enabled or len(token_ids) <= self.block_size:
            return 0
        hashes = self.prompt_hashes(token_ids, cache_salt)
        return self.tiers.deepest(hashes, (len(token_ids) - 1) // self.block_size) * self.block_size

    def admitted(self, r: Request, match: PrefixMatch) -> None:
        """r started at `match`: its hit is counted, its hints set (num_hashed_blocks,
        resumed_from, branch_point), and it now computes its prompt's uncached blocks, learning the
        boundaries the burst plan wants its state at (r.shared)."""
        bs, m = self.block_size, match.blocks
        hit = m * bs
        r.num_hashed_blocks, r.resumed_from = m, hit
        r.shared.clear()
        # Only a real junction (another cached continuation), not the end of a cached sequence.
        r.branch_point = match.kv_blocks * bs if match.kv_blocks > m and match.branches else None
        self.hits.record(len(r.token_ids), hit, match.miss)
        if self.enabled:
            planned = self.bursts.admitted(r.request_id, r.block_hashes[m:(r.num_prompt_tokens - 1) // bs], hit)
            if self.recurrent is not None:
                r.shared.extend(planned)

    # ---- bursts ----------------------------------------------------------------------------
    def plan_bursts(self, candidates: Sequence[tuple[Hashable, Sequence[int], Optional[str]]]) -> None:
        """Before a step admits new requests: the next waiting ones in queue order, as (req_id,
        token_ids, cache_salt); those the manager holds (preempted) are left out. A leader of a
        burst learns where to checkpoint before its first chunk is cut (memory/burst.py)."""
        if self.enabled and len(candidates) > 1:
            candidates = [c for c in candidates if c[0] not in self._requests]
            if len(candidates) > 1:
                self.bursts.plan(candidates)

    def waits_for_shared_prefix(self, req_id: Hashable, token_ids: Sequence[int], *,
                                cache_salt: Optional[str] = None) -> bool:
        """The burst rule: True when a not-yet-admitted request shares blocks beyond its usable
        hit with a running request that has not computed them yet; that request is asked to
        checkpoint at the deepest shared boundary. Hold this one a step. Changes nothing else;
        False whenever waiting would not save work."""
        if not self.enabled or req_id in self._requests or len(token_ids) <= self.block_size:
            return False
        leader, boundary = self.bursts.leader_for(req_id, token_ids, cache_salt)
        lead = self._requests.get(leader)
        if lead is None or lead.status is not RUNNING or lead.num_computed_tokens >= boundary:
            return False
        if self.recurrent is not None and boundary not in lead.shared:
            lead.shared.append(boundary)
        self.bursts.waits += 1
        return True

    # ---- disk reads ahead of admission ----------------------------------------------------------
    def waits_for_disk_read(self, r: Request) -> bool:
        """The read-ahead rule (memory/disk_read_ahead.py): True while r, waiting (new, or preempted
        by recompute), should be held a step because the disk files its hit takes are being read
        off the step; starts those reads when the disk takes r's prefix deeper than the device and
        the host do. False when there is nothing (left) to read: admit r as usual. Sets only r's
        hash fields (as admission does)."""
        if self.read_ahead is None or not self.enabled or len(r.token_ids) <= self.block_size:
            return False
        hashes = self.hashes(self.keyed(r))
        limit = min((len(r.token_ids) - 1) // self.block_size, len(hashes))
        return self.read_ahead.waits(r.request_id, hashes, limit, self.match(r).blocks)

    def forget_disk_read(self, req_id: Hashable) -> None:
        """A waiting request left (finished, aborted, failed): its disk reads end unused."""
        if self.read_ahead is not None:
            self.read_ahead.forget(req_id)

    def wait_for_disk_reads(self, timeout: float) -> None:
        """Block until a disk read in flight finishes or `timeout` seconds pass (at once when none
        is): for a step that scheduled nothing while requests wait for reads."""
        if self.read_ahead is not None:
            self.read_ahead.wait(timeout)

    # ---- state checkpoints -----------------------------------------------------------------
    def checkpoint_due(self, req_id: Hashable, start: int, end: int) -> Optional[int]:
        """The first block boundary in (start, end] where the policy wants the state kept, else None."""
        if self.recurrent is None or not self.enabled or end // self.block_size == start // self.block_size:
            return None  # every checkpoint sits at a block boundary: none in (start, end] here
        r = self._requests[req_id]
        return self.policy.due(start, end, r.num_prompt_tokens, r.branch_point, r.shared, r.resumed_from)

    def checkpoint(self, req_id: Hashable) -> bool:
        """Copy a running request's live state into a checkpoint keyed by the hash of the block
        ending at num_computed_tokens (a block boundary). False if one exists already, caching is
        off, or no slot can be freed."""
        r = self._requests.get(req_id)
        if r is None or r.status is not RUNNING:
            raise RequestStateError(f"checkpoint of {req_id!r}: it is {'unknown' if r is None else r.status}, "
                                    f"not running")
        if self.recurrent is None or not self.enabled:
            return False
        nc, bs = r.num_computed_tokens, self.block_size
        if nc == 0 or nc % bs:
            raise RequestStateError(
                f"checkpoint of {req_id!r} at num_computed_tokens={nc}, not a block boundary (block_size "
                f"{bs}): cut the chunk where checkpoint_due() says")
        return self.store(r, nc)

    def store(self, r: Request, position: int, source: Optional[int] = None, mark: bool = True) -> bool:
        """Keep the state after `position` (a block boundary) tokens of r from slot `source` (None:
        the live state, after num_computed_tokens) under the hash of the block ending there.
        mark: first make that block findable in every kind (False: the commit that hashed it did)."""
        h = self._boundary(r, position) if mark else r.block_hashes[position // self.block_size - 1]
        output = position > r.num_prompt_tokens and self.policy.rolling_output
        kept = self.recurrent.checkpoint(r.request_id, h, position, output, source)
        if kept and self.disk is not None:  # written through: a restart finds it
            self.disk.write_checkpoint(r.request_id, r.block_hashes, position)
        return kept

    def donation(self, r: Request) -> Optional[tuple[bytes, int]]:
        """Where r's live state, about to be let go, can stay as a checkpoint: (hash, position) at
        num_computed_tokens when that is a block boundary, else None."""
        nc = r.num_computed_tokens
        if self.recurrent is None or not self.enabled or not nc or nc % self.block_size:
            return None
        return self._boundary(r, nc), nc

    def _boundary(self, r: Request, position: int) -> bytes:
        """Hash of the block ending at `position`, made findable in every kind."""
        i = position // self.block_size - 1
        for kind in self.kinds:
            kind.mark_boundary(r.request_id, i, r.block_hashes[i])
        return r.block_hashes[i]

    def invalidate(self, key: bytes) -> bool:
        """Drop the state checkpoint keyed `key` (a block hash) from every tier, so no later match
        uses it (the prefix-hit guard found it wrong); False when no tier held it."""
        on_disk = self.disk is not None and self.disk.invalidate(key)
        return self.recurrent is not None and self.recurrent.store.invalidate(key) or on_disk

    def batched_checkpoints(self):
        """A context in which checkpoints keep their bookkeeping but copy the states at the exit,
        one gather and scatter per tensor (a step's checkpoints together)."""
        if self.recurrent is None:
            return contextlib.nullcontext()
        return self.recurrent.states.deferred_copies()
