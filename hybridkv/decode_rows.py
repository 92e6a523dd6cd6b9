"""Where a fixed list of running requests lives in the pools, as arrays: the handle of the
manager's batched one-token verbs (`allocate_decodes`, `commit_decodes`).

A decode step touches every running request, so it should cost numpy calls over arrays, not a
lookup per request in each kind's dicts. `HybridCacheManager.decode_rows(req_ids)` looks each
request up once (its `RequestState`, its block-table row and block count in every attention
group, its live state slot); the scheduler keeps the handle while the same requests go on
decoding, and the verbs keep its block counts up to date as they hand out blocks. It stays
valid while each of its requests is running and gets blocks only through `allocate_decodes`
with this handle: a request that is preempted, finished, forked from, or allocated for on its
own (a prefill chunk) needs a new one.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Optional

import numpy as np

from hybridkv.memory.full_attention import FullAttentionMemory
from hybridkv.request_state import RequestState


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

    def add_blocks(self, req_ids: list, idx: np.ndarray) -> None:
        """One new block at the end of each of rows idx (req_ids: the handle's), held alone."""
        self.kind.add_decode_blocks([req_ids[i] for i in idx.tolist()], self.rows[idx], self.held[idx])
        self.alone[idx] = self.held[idx]
        self.held[idx] += 1

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
    """req_ids in a fixed order; states: their RequestStates; num_prompt: int64 [R];
    state_slots: int32 [R] (0 without recurrent layers); groups: {window: GroupRows} in the
    manager's attention-group order; lead: the lead group's (None without attention)."""

    req_ids: list
    states: list[RequestState]
    num_prompt: np.ndarray
    state_slots: np.ndarray
    groups: dict[Optional[int], GroupRows]
    lead: Optional[GroupRows]
    # (starts, lead slots) of the last allocate_decodes that placed every token: the next one,
    # a token later each, continues from them
    last: Optional[tuple[np.ndarray, np.ndarray]] = None

    def __len__(self) -> int:
        return len(self.req_ids)

    @classmethod
    def of(cls, req_ids: list, states: list[RequestState], state_slots: list[int],
           attention_groups: dict[Optional[int], FullAttentionMemory],
           lead: Optional[FullAttentionMemory]) -> "DecodeRows":
        groups = {w: GroupRows.of(kind, req_ids) for w, kind in attention_groups.items()}
        lead_rows = next((g for g in groups.values() if g.kind is lead), None)
        return cls(req_ids, states, np.fromiter(map(_num_prompt, states), np.int64, len(states)),
                   np.asarray(state_slots, dtype=np.int32), groups, lead_rows)

    def group_of(self, kind) -> Optional[GroupRows]:
        return next((g for g in self.groups.values() if g.kind is kind), None)


_num_prompt = attrgetter("num_prompt_tokens")
