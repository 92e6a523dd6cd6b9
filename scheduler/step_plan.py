"""What the scheduler hands the engine for one step: chunks of tokens to compute, and the steady
decodes as one array-based `DecodeBatch`.

A `ScheduledChunk` is one sequence's tokens from a position. When every running sequence is a
plain decode (one token left, past its prompt), the step is a `DecodeBatch` instead: the same
information for all of them as arrays and lists, made without an object per sequence, and kept
from one step to the next while nobody joins or leaves the running queue (its positions advance
by one). `DecodeBatch.chunks()` gives the chunks the general path would have had, for steps that
mix it with other work.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Optional

import numpy as np
import torch

from hybridkv.decode_rows import DecodeRows

from hybridkv.request import Request, RequestStatus

_RUNNING = RequestStatus.RUNNING
_request_id = attrgetter("request_id")
_num_computed = attrgetter("num_computed_tokens")
_num_prompt = attrgetter("num_prompt_tokens")
_token_ids = attrgetter("token_ids")


@dataclass(slots=True)
class ScheduledChunk:
    """`num_tokens` tokens of `seq` from position `start`; `checkpoint` if a state checkpoint is
    due once they are computed. `decode`: one token past the prompt (no prompt logprobs, no forks
    to make): the engine commits those together."""

    seq: Request
    start: int
    num_tokens: int
    slot_mapping: list[int]
    checkpoint: bool = False
    decode: bool = False


@dataclass(slots=True)
class DecodeBatch:
    """One token for each of `seqs` (run order): the token at `positions[i]` (int64, the
    sequence's num_computed_tokens; its last token), written to KV slot `kv_slots[i]` of the lead
    attention group (-1 without attention); `checkpoints`: indices of those due a state
    checkpoint after it. `rows`: the manager's handle on their memory (hybridkv/decode_rows.py).
    `version`: the running queue's version this batch was made for. What stays the same while
    these sequences decode together is made once and handed from step to step: `all_greedy` (every
    row greedy without logprobs; set by the runner), `stops` (the rows' stop rules as arrays,
    token_append.BatchStops; set by the scheduler) and `cpu_fields` (the CPU forward batch's
    constant fields; set by the batch builder). `input_ids`: the tokens at `positions` as an
    int64 tensor when the step before sampled them (else read from the sequences)."""

    seqs: list[Request]
    rows: DecodeRows
    positions: np.ndarray
    version: int
    kv_slots: Optional[np.ndarray] = None  # set once the manager allocated them
    checkpoints: list[int] = field(default_factory=list)
    all_greedy: Optional[bool] = None
    stops: Optional[object] = None  # token_append.BatchStops
    cpu_fields: Optional[tuple] = None
    input_ids: Optional[torch.Tensor] = None
    sampled: Optional[torch.Tensor] = None  # this step's sampled tokens, once the engine has them
    added: int = 0  # the running queue's count of adds this batch was made for
    cut: bool = False  # made by cutting the last batch to the sequences left (`kept`)

    @classmethod
    def of_running(cls, running, last: Optional["DecodeBatch"], manager) -> Optional["DecodeBatch"]:
        """The running queue (sequence_queue.py) as one DecodeBatch (positions only) when every
        sequence in it is a plain decode (one token left, past its prompt), else None. After
        `last`, the batch run whole in the step before, and while nobody joined or left since, it
        is that batch one token later: no look at each sequence; when some left and nobody
        joined, it is that batch cut to those left (`kept`)."""
        n = len(running)
        if last is not None and last.version == running.version:
            return last.advanced(running.version)
        if last is not None and last.added == running.added:  # some left, nobody joined: cut the batch
            keep = [i for i, seq in enumerate(last.seqs) if seq.status is _RUNNING]
            if len(keep) == n:
                return last.kept(keep, running.version)
        seqs = list(running)  # run order
        positions = np.fromiter(map(_num_computed, seqs), np.int64, n)
        known = np.fromiter(map(len, map(_token_ids, seqs)), np.int64, n)
        prompt = np.fromiter(map(_num_prompt, seqs), np.int64, n)
        if not ((known - positions == 1) & (positions >= prompt)).all():
            return None
        return cls(seqs, manager.decode_rows([s.request_id for s in seqs]), positions, running.version,
                   added=running.added)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def req_ids(self) -> list:
        return self.rows.req_ids

    def advanced(self, version: int) -> "DecodeBatch":
        """The same sequences one token later (each computed and appended one), for `version`:
        at the starts the manager's commit left (`rows.next`: passing them back tells it the
        step continues the last one), reading the tokens sampled last step."""
        after = self.rows.next
        return DecodeBatch(self.seqs, self.rows, self.positions + 1 if after is None else after, version,
                           all_greedy=self.all_greedy, stops=self.stops, cpu_fields=self.cpu_fields,
                           input_ids=self.sampled, added=self.added)

    def kept(self, idx: list[int], version: int) -> "DecodeBatch":
        """advanced() for the sequences idx (ascending) alone, once the others left the running
        queue: the handle cut to them (`DecodeRows.kept`), still continuing the last step. Rows
        cut from all-greedy rows are all greedy; the stop rules are cut; the CPU fields are made again."""
        rows = self.rows.kept(idx)
        sampled = self.sampled[torch.from_numpy(np.asarray(idx, dtype=np.int64))] if self.sampled is not None else None
        return DecodeBatch([self.seqs[i] for i in idx], rows, rows.next if rows.next is not None
                           else self.positions[idx] + 1, version, all_greedy=True if self.all_greedy else None,
                           stops=self.stops.keep(idx) if self.stops is not None else None,
                           input_ids=sampled, added=self.added, cut=True)

    def chunks(self) -> list[ScheduledChunk]:
        """The general path's chunks for these decodes (allocated: kv_slots set)."""
        due = set(self.checkpoints)
        return [ScheduledChunk(seq, start, 1, [slot], i in due, True) for i, (seq, start, slot) in
                enumerate(zip(self.seqs, self.positions.tolist(), self.kv_slots.tolist()))]


@dataclass
class SchedulerOutput:
    """chunks: in batch order; decodes: the step's steady decodes (they run before the chunks),
    or None; preempted: (sequence, "recompute" | "swap"); failed: ended with "error" while
    scheduling."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[tuple[Request, str]] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)
    decodes: Optional[DecodeBatch] = None

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks) + (len(self.decodes) if self.decodes else 0)

    @property
    def num_seqs(self) -> int:
        return len(self.chunks) + (len(self.decodes) if self.decodes else 0)

    def seqs(self) -> list[Request]:
        """The step's sequences in batch order."""
        return (list(self.decodes.seqs) if self.decodes else []) + [c.seq for c in self.chunks]

    def all_chunks(self) -> list[ScheduledChunk]:
        """Every scheduled chunk in batch order, the decode batch's as chunks."""
        return (self.decodes.chunks() if self.decodes else []) + self.chunks
