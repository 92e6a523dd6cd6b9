"""Migrate: move a live request, KV and state together, to another engine of the same model.

`freeze` turns a request (n == 1) into a `RequestSnapshot`: the manager's KV of the computed tokens
and the live slot, plus the sampling state kept here (request_validation.py's SAMPLING_STATE:
prompt text, params, priority, logprobs so far, cached tokens). `export_request` freezes and
releases it. `import_request` continues a snapshot the engine's RequestValidator has checked
(the one schema, before anything is allocated): `thaw` rebuilds the request, then the manager
checks the tensors and takes its memory, all or nothing. An import is a transaction: whatever
fails after the manager took memory gives it all back, and the error is raised with nothing
held. A seeded sampler's draws depend only on (seed, sequence index, step), so greedy and seeded
outputs are identical to never having moved. A request that holds no memory now (waiting, or
preempted) moves as tokens and is recomputed on arrival.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from hybridkv.cache_manager import HybridCacheManager
from hybridkv.errors import RequestTooLargeError, SnapshotMismatchError
from hybridkv.outputs import Logprob
from hybridkv.request import RequestStatus
from hybridkv.sampling_params import SamplingParams
from hybridkv.snapshot import RequestSnapshot
from hybridkv.snapshot_transfer import request_of

from .request_group import RequestGroup


def freeze(group: RequestGroup, mgr: HybridCacheManager) -> RequestSnapshot:
    """The snapshot of an unfinished n == 1 request; ValueError otherwise. Changes nothing."""
    if group.params.n != 1:
        raise ValueError(f"request {group.request_id!r} has n={group.params.n} sequences; only n == 1 "
                         "requests can migrate")
    seq = group.seqs[0]
    if seq.finished:
        raise ValueError(f"request {group.request_id!r} has finished; there is nothing to migrate")
    state = {"prompt": group.prompt, "params": dataclasses.asdict(group.params), "priority": seq.priority,
             "output_logprobs": [{str(k): v for k, v in d.items()} for d in seq.output_logprobs],
             "num_cached_tokens": seq.num_cached_tokens}
    if seq.status is RequestStatus.RUNNING:
        return mgr.export_snapshot(seq.request_id, sampling_state=state)
    # holds no memory here: the tokens are all it needs
    return RequestSnapshot(seq.request_id, list(seq.token_ids), seq.num_prompt_tokens, 0,
                           group.params.max_tokens, {}, {}, {}, mgr.fingerprint, mgr.block_size,
                           seq.cache_salt, sampling_state=state)


def thaw(snap: RequestSnapshot, params: SamplingParams, max_tokens: int) -> RequestGroup:
    """The request group of a checked snapshot (its one sequence holds no memory yet)."""
    st = snap.sampling_state
    seq = request_of(snap, snap.req_id, params)
    seq.max_tokens, seq.priority, seq.num_cached_tokens = max_tokens, st["priority"], st["num_cached_tokens"]
    seq.output_logprobs = [{int(k): Logprob(*v) if isinstance(v, (list, tuple)) else Logprob(v)
                            for k, v in d.items()} for d in st["output_logprobs"]]  # JSON made them lists
    return RequestGroup(snap.req_id, st["prompt"], params, [seq])


def export_request(sched, g: RequestGroup) -> RequestSnapshot:
    """Freeze request `g` (n == 1) of Scheduler `sched` into a snapshot and release it there."""
    snap = freeze(g, sched.mgr)
    del sched.groups[g.key]
    sched.finish(g.seqs[0], "migrated")
    return snap


def import_request(sched, snap: RequestSnapshot, params: SamplingParams,
                   max_new_tokens: Callable[[int, SamplingParams], int]) -> None:
    """Continue `snap` (checked: RequestValidator.check_snapshot, which gave `params`) on Scheduler
    `sched`: its memory to the manager (or, moved as tokens, queued for recompute).
    max_new_tokens(num prompt tokens, params): the engine's length limit. Raises
    SnapshotMismatchError when the manager refuses its tensors, RuntimeError when the pools cannot
    take it now; in every case nothing is held."""
    g = thaw(snap, params, max_new_tokens(snap.num_prompt_tokens, params))
    seq, mgr = g.seqs[0], sched.mgr
    rid = seq.request_id
    holds = snap.num_computed_tokens > 0
    if holds:
        try:
            taken = mgr.import_snapshot(snap, seq, num_new_tokens=1)
        except RequestTooLargeError as e:  # its own max_tokens claim, never one of ours
            raise SnapshotMismatchError(f"snapshot {rid!r} could never fit here: {e}") from None
        if not taken:
            raise RuntimeError(f"cannot import request {rid!r} now: its {snap.num_computed_tokens} tokens "
                               f"of KV and its state do not fit the free pools ({mgr.stats()})")
    try:
        if holds and not 0 <= seq.num_computed_tokens < seq.num_tokens:  # what the next step reads
            raise SnapshotMismatchError(f"imported request {rid!r} has {seq.num_computed_tokens} of its "
                                        f"{seq.num_tokens} tokens computed; one must be left to compute")
        if holds:
            sched.add_running(seq)
        else:
            sched.add(seq)
        sched.groups[g.key] = g
    except BaseException:  # a transaction: nothing of it stays
        for queue in (sched.running, sched.waiting):
            queue.remove(seq)
        if sched.groups.get(g.key) is g:
            del sched.groups[g.key]
        if rid in mgr.requests:
            mgr.finish(rid, discard=True)
        raise
