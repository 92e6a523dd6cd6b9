"""What the scheduler hands the model runner for one step: the running decodes as one
array-based `DecodeBatch`, and chunks of tokens to compute for everything else.

Every running request past its prompt with one token left to compute (a plain decode) is a row
of the step's `DecodeBatch`: positions, KV write slots and the rows due a state checkpoint as
arrays, the manager's handle on their memory (`DecodeRows`), through which it allocates (`allocate`)
and commits (`commit`) every row in one call each. It is the only way a decode is scheduled and
committed. When it held every running request, the next step carries it over
(one token later, or cut to those left when some left and nobody joined) without a look at each
request. A `ScheduledChunk` is one request's tokens from a position: a prefill chunk, or the
last prompt token (it may collect prompt logprobs and make forks). `DecodeBatch.chunks()` is the
batch in the batch builder's form when a step mixes the two.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from hybridkv.decode_rows import DecodeRows
from hybridkv.request import Request, RequestStatus


_RUNNING = RequestStatus.RUNNING
_num_computed = attrgetter("num_computed_tokens")
_num_prompt = attrgetter("num_prompt_tokens")
_token_ids = attrgetter("token_ids")


@dataclass(slots=True)
class ScheduledChunk:
    """`num_tokens` tokens of `seq` from position `start`; `checkpoint` if a state checkpoint is
    due once they are computed. `decode`: a row of the decode batch in chunk form (one token past
    the prompt: no prompt logprobs, no forks to make). `draft`: a decode that verifies these
    proposed tokens (speculation.py): its tokens are its last one then the draft, every position
    is sampled, and `verify_slots` is its state slot chain (live slot, then one per token; []
    without recurrent layers). `verify_slots` without a draft: a draft model's speculative
    position (speculative/draft_model.py): its tokens are the sequence's, their states go to the
    chain's slots after the first, which they start from. `keep_logits`: the runner returns the
    raw logits of its sampled row (the prefix-hit guard, hit_guard.py)."""

    seq: Request
    start: int
    num_tokens: int
    slot_mapping: list[int]
    checkpoint: bool = False
    decode: bool = False
    draft: Sequence[int] = ()
    verify_slots: Sequence[int] = ()
    keep_logits: bool = False


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
    whole: bool = True  # holds every running request: the next step may carry it over
    carried: bool = False  # carried over from the step before (`advanced` or `kept`)

    @classmethod
    def of_running(cls, running, last: Optional["DecodeBatch"], manager, budget: int
                   ) -> tuple[Optional["DecodeBatch"], list[tuple[int, Request]]]:
        """(the step's decode batch, positions only, or None; the other running requests as
        (num_computed_tokens, request), those with one prompt token left first, then the
        prefills, each in run order). At most `budget` decodes, the first in run order; the
        others wait. `last`: the batch the step before ran and committed whole (holding every
        running request), or None: while nobody joined or left the running queue since, this
        step's is that batch one token later, without a look at each request; when some left and
        nobody joined, it is that batch cut to those left (`kept`)."""
        n = len(running)
        if last is not None and last.version == running.version and n <= budget:
            return last.advanced(running.version), []
        if last is not None and last.added == running.added and n <= budget:  # some left, nobody joined
            keep = [i for i, seq in enumerate(last.seqs) if seq.status is _RUNNING]
            if len(keep) == n:
                return last.kept(keep, running.version), []
        seqs = list(running)  # run order
        positions = np.fromiter(map(_num_computed, seqs), np.int64, n)
        left = np.fromiter(map(len, map(_token_ids, seqs)), np.int64, n) - positions
        decode = (left == 1) & (positions >= np.fromiter(map(_num_prompt, seqs), np.int64, n))
        rest: list[tuple[int, Request]] = []
        if not decode.all():
            idx = np.flatnonzero(decode)
            starts = positions.tolist()
            rest = ([(starts[i], seqs[i]) for i in np.flatnonzero(~decode & (left <= 1)).tolist()]
                    + [(starts[i], seqs[i]) for i in np.flatnonzero(left > 1).tolist()])
            seqs, positions = [seqs[i] for i in idx.tolist()], positions[idx]
        whole = not rest and len(seqs) <= budget
        seqs, positions = seqs[:budget], positions[:budget]
        if not seqs:
            return None, rest
        return cls(seqs, manager.decode_rows(seqs), positions, running.version, added=running.added,
                   whole=whole), rest

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
                           input_ids=self.sampled, added=self.added, carried=True)

    def without(self, keep: list[int]) -> Optional["DecodeBatch"]:
        """This step's batch of rows `keep` (ascending) alone, once the others were preempted or
        failed while scheduling (None when none is left); it is not carried to the next step."""
        if not keep:
            return None
        sel = np.asarray(keep, dtype=np.int64)
        rows = self.rows.kept(keep)
        batch = DecodeBatch([self.seqs[i] for i in keep], rows, self.positions[sel], self.version,
                            all_greedy=True if self.all_greedy else None,
                            stops=self.stops.keep(keep) if self.stops is not None else None,
                            input_ids=self.input_ids[torch.from_numpy(sel)] if self.input_ids is not None else None,
                            added=self.added, whole=False)
        if self.kv_slots is not None:
            new = {old: j for j, old in enumerate(keep)}
            batch.kv_slots = self.kv_slots[sel]
            batch.checkpoints = [new[i] for i in self.checkpoints if i in new]
        return batch

    def kept(self, idx: list[int], version: int) -> "DecodeBatch":
        """advanced() for the sequences idx (ascending) alone, once the others left the running
        queue: the handle cut to them (`DecodeRows.kept`), still continuing the last step. Rows
        cut from all-greedy rows are all greedy; the stop rules are cut; the CPU fields are made again."""
        rows = self.rows.kept(idx)
        sampled = self.sampled[torch.from_numpy(np.asarray(idx, dtype=np.int64))] if self.sampled is not None else None
        return DecodeBatch([self.seqs[i] for i in idx], rows, rows.next if rows.next is not None
                           else self.positions[idx] + 1, version, all_greedy=True if self.all_greedy else None,
                           stops=self.stops.keep(idx) if self.stops is not None else None,
                           input_ids=sampled, added=self.added, cut=True, carried=True)

    def allocate(self, preempt_last: Callable[[], None]) -> Optional["DecodeBatch"]:
        """KV slots and due checkpoints for every row in one manager call (sets kv_slots and
        checkpoints). When a pool is short, preempt_last() preempts the last running request in
        run order (a decode or a prefill) and the rows still running ask again, until every row
        left has its slot; returns the batch of those rows, or None when none is left."""
        batch = self
        while True:
            slots, due, done = batch.rows.allocate(batch.positions)
            if done.all():
                batch.kv_slots, batch.checkpoints = slots, np.flatnonzero(due).tolist()
                return batch
            preempt_last()
            keep = [i for i, seq in enumerate(batch.seqs) if seq.status is _RUNNING]
            if len(keep) < len(batch):
                batch = batch.without(keep)
                if batch is None:
                    return None

    def commit(self, ended: bool, fail: Callable[[int, BaseException, bool], None]) -> bool:
        """After the forward pass: every row's token committed in one manager call, then the
        checkpoints due taken. ended: some rows ended this step (failed, or their logits were not
        finite): those left commit through a handle of their own. fail(row, error, discard) ends
        the request of a row whose commit (discard: True) or checkpoint (False) raised. Returns
        whether the batch ran whole (no row ended, failed or raised)."""
        seqs = self.seqs
        if ended:
            keep = [j for j, seq in enumerate(seqs) if not seq.finished]
            errors = {keep[k]: e for k, e in
                      self.rows.kept(keep).commit(self.positions[keep]).items()} if keep else {}
        else:
            errors = self.rows.commit(self.positions)
        for j, e in errors.items():
            fail(j, e, True)
        failed = False
        for i in self.checkpoints:
            if (ended or errors or failed) and seqs[i].finished:
                continue
            try:
                self.rows.checkpoint(i)
            except Exception as e:
                fail(i, e, False)
                failed = True
        return not (ended or errors or failed)

    def chunks(self) -> list[ScheduledChunk]:
        """The general path's chunks for these decodes (allocated: kv_slots set)."""
        due = set(self.checkpoints)
        return [ScheduledChunk(seq, start, 1, [slot], i in due, True) for i, (seq, start, slot) in
                enumerate(zip(self.seqs, self.positions.tolist(), self.kv_slots.tolist()))]


@dataclass
class SchedulerOutput:
    """chunks: in batch order; decodes: the step's steady decodes (they run before the chunks),
    or None; preempted: (sequence, "recompute" | "swap"); failed: ended with "error" while
    scheduling; held: waiting requests held back this step (burst rule, disk reads ahead)."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[tuple[Request, str]] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)
    decodes: Optional[DecodeBatch] = None
    held: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks) + (len(self.decodes) if self.decodes else 0)

    @property
    def num_seqs(self) -> int:
        return len(self.chunks) + (len(self.decodes) if self.decodes else 0)

    def drop(self, seq: Request) -> None:
        """The step without `seq` (preempted while the step is planned): its chunks, its decode row."""
        self.chunks = [c for c in self.chunks if c.seq is not seq]
        if self.decodes is not None and any(s is seq for s in self.decodes.seqs):
            self.decodes = self.decodes.without([i for i, s in enumerate(self.decodes.seqs) if s is not seq])

    def seqs(self) -> list[Request]:
        """The step's sequences in batch order."""
        return (list(self.decodes.seqs) if self.decodes else []) + [c.seq for c in self.chunks]

    def all_chunks(self) -> list[ScheduledChunk]:
        """Every scheduled chunk in batch order, the decode batch's as chunks."""
        return (self.decodes.chunks() if self.decodes else []) + self.chunks
