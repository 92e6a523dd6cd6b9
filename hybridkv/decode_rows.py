"""A fixed list of running requests that decode one token a step: where they live in the pools,
as arrays, and the batched one-token verbs over them (`allocate`, `commit`, `checkpoint`), made
by the manager (`HybridCacheManager.decode_rows`).

A decode step touches every running request, so it should cost numpy calls over arrays, not a
lookup per request in each kind's dicts. `HybridCacheManager.decode_rows(req_ids)` looks each
request up once (its `Request`, its block-table row and block count in every attention
group, its live state slot); the scheduler keeps the handle while the same requests go on
decoding, and the verbs keep its block counts up to date as they hand out blocks.

Steady steps. A step that continues the one before (the same handle, every token it placed
committed, each start one further) needs no look at each request: a token inside the block of
the one before writes the next slot of that block, which the request holds alone (only full,
hashed blocks are found by others). Which requests start a block, and which fill one (its hash,
its checkpoint), follows from the phase: the rows are put in buckets once, by position modulo
the block size, and k steps later bucket (-k) mod block_size starts blocks and bucket
(block_size - 1 - k) fills them. What is left per request is the advance of its
num_computed_tokens (and, in the engine, its token).

The handle stays valid while each of its requests is running and gets blocks only through
its `allocate`: a request that is preempted, finished, forked from, or
allocated for on its own (a prefill chunk) needs a new one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Optional

import numpy as np

from hybridkv.memory.full_attention import FullAttentionMemory
from hybridkv.request import Request

# The manager that made a handle (a HybridCacheManager); not imported, so the arrow between the two
# modules points one way: cache_manager -> decode_rows.
Manager = Any


@dataclass
class GroupRows:
    """One attention group's view: each request's row in `kind.tables`, how many table
    positions (blocks, let go or not) it holds, and the table position whose block it is known
    to hold alone (-1: not known)."""

    kind: FullAttentionMemory
    rows: np.ndarray  # int64 [R]
    held: np.ndarray  # int64 [R]
    alone: np.ndarray  # int64 [R]

    @classmethod
    def of(cls, kind: FullAttentionMemory, req_ids: list) -> "GroupRows":
        n = len(req_ids)
        return cls(kind, np.fromiter(map(kind.table_row, req_ids), np.int64, n),
                   np.fromiter(map(len, map(kind.block_ids, req_ids)), np.int64, n), np.full(n, -1, dtype=np.int64))

    def add_blocks(self, req_ids: list, idx: np.ndarray) -> np.ndarray:
        """One new block at the end of each of rows idx (req_ids: the handle's), held alone;
        returns their ids (int64)."""
        held = self.held[idx]
        new = np.array(self.kind.add_decode_blocks([req_ids[i] for i in idx.tolist()], self.rows[idx], held),
                       dtype=np.int64)
        self.alone[idx] = held
        self.held[idx] = held + 1
        return new

    def slots(self, idx: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """int64 KV write slots of rows idx at positions starts[idx], from their table rows."""
        bs, pos = self.kind.block_size, starts[idx]
        return self.kind.tables.array[self.rows[idx], pos // bs].astype(np.int64) * bs + pos % bs

    def table(self) -> np.ndarray:
        """int32 [R, longest] block ids (entries past a request's blocks are stale: unused)."""
        width = max(1, int(self.held.max(initial=1)))
        array = self.kind.tables.array
        if width > array.shape[1]:
            out = np.zeros((len(self.rows), width), dtype=np.int32)
            out[:, :array.shape[1]] = array[self.rows]
            return out
        return array[self.rows, :width]


@dataclass
class DecodeRows:
    """req_ids in a fixed order; states: their Requests; num_prompt: int64 [R];
    state_slots: int32 [R] (0 without recurrent layers); groups: {window: GroupRows} in the
    manager's attention-group order; lead: the lead group's (None without attention)."""

    mgr: Manager
    req_ids: list
    states: list[Request]
    num_prompt: np.ndarray
    state_slots: np.ndarray
    groups: dict[Optional[int], GroupRows]
    lead: Optional[GroupRows]
    # (starts, lead slots) of the last allocate that placed every token
    last: Optional[tuple[np.ndarray, np.ndarray]] = None
    # the starts after the last placed tokens, once commit committed every one of them: the
    # next step's starts (passing this very array tells allocate the step continues)
    next: Optional[np.ndarray] = None
    _allocating: list[GroupRows] = field(init=False)  # the groups of the manager's allocating kinds
    _ready: np.ndarray = field(init=False)  # all True, read only
    _buckets: Optional[list[np.ndarray]] = None  # rows by start % block_size at phase 0
    _phase: int = 0  # steps continued since the buckets were made
    _fills: Optional[np.ndarray] = None  # rows whose token, placed by the last continuation, fills a block

    def __post_init__(self) -> None:
        self._allocating = [self.group_of(kind) for kind in self.mgr.allocating_kinds]
        self._ready = np.ones(len(self.req_ids), dtype=bool)
        self._ready.flags.writeable = False

    def __len__(self) -> int:
        return len(self.req_ids)

    @classmethod
    def of(cls, mgr: Manager, req_ids: list, states: list[Request],
           state_slots: list[int]) -> "DecodeRows":
        groups = {w: GroupRows.of(kind, req_ids) for w, kind in mgr.attention_groups.items()}
        lead = next((g for g in groups.values() if g.kind is mgr.attention), None)
        return cls(mgr, req_ids, states, np.fromiter(map(_num_prompt, states), np.int64, len(states)),
                   np.asarray(state_slots, dtype=np.int32), groups, lead)

    def group_of(self, kind) -> Optional[GroupRows]:
        return next((g for g in self.groups.values() if g.kind is kind), None)

    def kept(self, idx: list[int]) -> "DecodeRows":
        """The handle of rows idx (ascending) alone, once the others left (finished, failed,
        preempted: their memory is no longer this handle's business): every array cut, the last
        step's placement and commit kept, so the next step still continues it (`next`)."""
        sel = np.asarray(idx, dtype=np.int64)
        groups = {w: GroupRows(g.kind, g.rows[sel], g.held[sel], g.alone[sel]) for w, g in self.groups.items()}
        lead = next((groups[w] for w, g in self.groups.items() if g is self.lead), None)
        rows = DecodeRows(self.mgr, [self.req_ids[i] for i in idx], [self.states[i] for i in idx],
                          self.num_prompt[sel], self.state_slots[sel], groups, lead)
        if self.last is not None:
            rows.last = (self.last[0][sel], self.last[1][sel])
        if self.next is not None:
            rows.next = self.next[sel]
        return rows

    # ---- allocate --------------------------------------------------------------------------
    def allocate(self, starts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """allocate(req_id, 1) and checkpoint_due for one token of each row at its
        num_computed_tokens starts[i], all at once: arrays of (KV write slot, int64, -1 without
        attention; whether a checkpoint is due after the token; whether it was allocated). Most
        tokens land in a block the request holds alone and need nothing; those that start a block
        get one, and a copy of a shared partial block is made, only when every pool can give all
        of them theirs, else none of them does (the scheduler then preempts and asks again). A
        step that continues the last one (`next`) costs no look at each request."""
        continues = starts is self.next
        starts = np.asarray(starts, dtype=np.int64)  # the same array when it is one already
        if continues or (self.last is not None and len(starts) == len(self)
                         and np.array_equal(self.last[0] + 1, starts)):
            placed = self._continue(starts, checked=continues)
            if placed is not None:
                return placed
        self._buckets = self._fills = self.next = None
        slots, ready = self._place(starts)
        self.last = (starts, slots) if ready.all() else None
        return slots, self._due(starts, np.flatnonzero(starts % self.mgr.block_size == self.mgr.block_size - 1)), ready

    def _continue(self, starts: np.ndarray, checked: bool) -> Optional[tuple]:
        """allocate() of the tokens one after those the last allocate placed (see the module
        doc); None when a pool cannot give every request that starts a block its block (the
        general way then hands out what it can). checked: every token the last allocate placed
        was committed (else the new blocks' places are checked)."""
        bs = self.mgr.block_size
        if self._buckets is None:
            self._bucket(starts)
        else:
            self._phase += 1
        fresh = self._buckets[-self._phase % bs]  # start a block
        slots = self.last[1] + 1 if self.lead is not None else self.last[1]
        if fresh.size:
            groups = self._allocating
            if any(fresh.size > g.kind.pool.num_free for g in groups) or not checked and not all(
                    (g.held[fresh] * bs == starts[fresh]).all() for g in groups):
                return None
            for g in groups:
                new = g.add_blocks(self.req_ids, fresh)
                if g is self.lead:
                    slots[fresh] = new * bs
        fills = self._fills = self._buckets[(bs - 1 - self._phase) % bs]
        self.last, self.next = (starts, slots), None
        return slots, self._due(starts, fills), self._ready

    def _bucket(self, starts: np.ndarray) -> None:
        """Rows by start % block_size (each bucket in row order): phase 0 at these starts."""
        bs = self.mgr.block_size
        phase = starts % bs
        order = np.argsort(phase, kind="stable")
        ends = np.cumsum(np.bincount(phase, minlength=bs)).tolist()
        self._buckets = [order[a:b] for a, b in zip([0] + ends[:-1], ends)]
        self._phase = 0

    def _place(self, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """allocate()'s (slots, ready), each kind asked where every token lands."""
        n, bs = len(self), self.mgr.block_size
        ready, slots = np.ones(n, dtype=bool), np.full(n, -1, dtype=np.int64)
        rooms = {}
        kinds = self.mgr.allocating_kinds
        for kind, group in zip(kinds, self._allocating):
            kind_slots, rooms[kind] = kind.decode_room(group.rows, group.held, group.alone, starts)
            ready &= rooms[kind]
            if group is self.lead:
                slots = kind_slots
        short = np.flatnonzero(~ready)
        if short.size and all(short.size <= k.pool.num_free for k in kinds):  # <= 1 block each
            for kind, group in zip(kinds, self._allocating):
                need = short[~rooms[kind][short]]
                at_end = starts[need] == group.held[need] * bs  # a token that starts the next block
                if at_end.all():  # the usual case: the pool hands them out in one call, in row order
                    group.add_blocks(self.req_ids, need)
                else:  # some copy a shared partial block (a fork's): one by one, in row order
                    for i in need.tolist():
                        rid, s = self.req_ids[i], int(starts[i])
                        kind.allocate(rid, s, s + 1)
                        group.held[i], group.alone[i] = len(kind.block_ids(rid)), s // bs
                if group is self.lead:
                    slots[short] = group.slots(short, starts)
            ready[short] = True
        return slots, ready

    def _due(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Bools: whether a state checkpoint is due after each row's token; ends: the rows whose
        token fills a block (checkpoints sit at block boundaries)."""
        pc = self.mgr.prefix_cache
        due = np.zeros(len(self), dtype=bool)
        if pc.recurrent is None or not pc.enabled or not ends.size:
            return due
        at = starts[ends]
        due[ends] = pc.policy.decodes_due(at + 1)  # past the prompt: the policy's own rule
        for i in ends[at < self.num_prompt[ends]].tolist():  # inside it: the request's own boundaries
            s = int(starts[i])
            due[i] = pc.checkpoint_due(self.req_ids[i], s, s + 1) is not None
        return due

    # ---- commit and checkpoint -------------------------------------------------------------
    def commit(self, starts: Optional[np.ndarray] = None) -> dict[int, Exception]:
        """The manager's commit(req_id, 1) for each row: the model computed one more token of
        each. starts: their num_computed_tokens as given to allocate (None: read here; given,
        each request's next token must be known). Those whose token fills no block and changes
        nothing else in any kind (past the prompt: no burst to drop) advance together, the others
        through commit(), in order. Each must hold its token's slot. Returns {index: the error}
        of those whose commit raised (each of them left as it was); the others are committed
        whatever happened to those."""
        mgr, states, req_ids = self.mgr, self.states, self.req_ids
        n, bs = len(self), mgr.block_size
        failed: dict[int, Exception] = {}
        placed = starts is not None and self.last is not None and starts is self.last[0]
        if starts is None:
            new = np.fromiter(map(_num_computed, states), np.int64, n) + 1
            alone = new <= np.fromiter(map(len, map(_token_ids, states)), np.int64, n)
            alone &= new > self.num_prompt
        else:
            new = starts + 1
            alone = new > self.num_prompt
        for kind in mgr.commit_checking_kinds:  # (the others are idle between block boundaries)
            idle = kind.decode_commit_idle(new)
            if idle is not True:
                alone &= idle
        fills = self._fills if placed and self._fills is not None else np.flatnonzero(new % bs == 0)
        if starts is not None and alone.all():  # the steady case: only the filling ones hash
            for r in states:
                r.num_computed_tokens += 1
            if fills.size:  # in order: the first of equal blocks is the cached one
                failed = mgr.advance_each(req_ids, states, fills.tolist(), new.tolist())
                for i in failed:
                    states[i].num_computed_tokens -= 1  # left as it was
        else:
            on_own = ~alone
            on_own[fills] = True
            for r, own in zip(states, on_own.tolist()):
                if not own:
                    r.num_computed_tokens += 1
            hash_only = alone.tolist() if starts is not None else None  # allocated and known
            for i in np.flatnonzero(on_own).tolist():  # in order
                try:
                    if hash_only is not None and hash_only[i]:
                        mgr.advance(req_ids[i], states[i], int(new[i]))
                    else:
                        mgr.commit(req_ids[i], 1)
                except Exception as e:
                    failed[i] = e
        if placed and not failed:
            self.next = new
        return failed

    def checkpoint(self, i: int) -> bool:
        """The prefix cache's checkpoint() of row i right after `commit` committed its token at a
        block boundary that `allocate` said was due: that commit hashed the block and made it
        findable in every kind, so only the state is kept."""
        pc = self.mgr.prefix_cache
        if pc.recurrent is None or not pc.enabled:
            return False
        r = self.states[i]
        return pc.store(r, r.num_computed_tokens, mark=False)


_num_prompt = attrgetter("num_prompt_tokens")
_num_computed = attrgetter("num_computed_tokens")
_token_ids = attrgetter("token_ids")
