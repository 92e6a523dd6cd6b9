"""Migrate: move a live request, KV and state together, to another engine of the same model.

`freeze` turns a request (n == 1) into a `RequestSnapshot`: the manager's KV of the computed tokens
and the live slot, plus the sampling state kept here (params, logprobs so far, priority). `thaw`
rebuilds the request on the receiving engine and hands its memory to that engine's manager. A
seeded sampler's draws depend only on (seed, sequence index, step), so greedy and seeded outputs
are identical to never having moved. A request that holds no memory now (waiting, or preempted)
moves as tokens and is recomputed on arrival. The engine queues and releases; this file only
converts.
"""
from __future__ import annotations

import dataclasses

from hybridkv.cache_manager import HybridCacheManager
from hybridkv.errors import SnapshotMismatchError
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
    state = {"prompt": group.prompt, "num_prompt_tokens": seq.num_prompt_tokens,
             "params": dataclasses.asdict(group.params), "priority": seq.priority,
             "output_logprobs": [{str(k): v for k, v in d.items()} for d in seq.output_logprobs],
             "num_cached_tokens": seq.num_cached_tokens}
    if seq.status is RequestStatus.RUNNING:
        return mgr.export_snapshot(seq.request_id, sampling_state=state)
    # holds no memory here: the tokens are all it needs
    return RequestSnapshot(seq.request_id, list(seq.token_ids), seq.num_prompt_tokens, 0,
                           group.params.max_tokens, {}, {}, {}, mgr.fingerprint, mgr.block_size,
                           seq.cache_salt, sampling_state=state)


def thaw(snap: RequestSnapshot, mgr: HybridCacheManager) -> tuple[RequestGroup, bool]:
    """Rebuild a migrated request: (its group, whether `mgr` now holds its memory as running).
    Raises SnapshotMismatchError for another model, RuntimeError when the pools cannot take its
    KV and state now (then nothing changed)."""
    if snap.fingerprint != mgr.fingerprint:
        raise SnapshotMismatchError(
            f"snapshot fingerprint {snap.fingerprint!r} != this engine's {mgr.fingerprint!r}: "
            "a request can only move between engines serving the same model and weights")
    st = snap.sampling_state
    rid = str(snap.req_id)
    params = SamplingParams(**st["params"])
    seq = request_of(snap, rid, params)
    seq.num_prompt_tokens, seq.max_tokens, seq.priority = st["num_prompt_tokens"], params.max_tokens, st["priority"]
    seq.output_logprobs = [{int(k): Logprob(*v) if isinstance(v, (list, tuple)) else Logprob(v)
                            for k, v in d.items()} for d in st["output_logprobs"]]  # JSON made them lists
    seq.num_cached_tokens = st["num_cached_tokens"]
    holds = snap.num_computed_tokens > 0
    if holds and not mgr.import_snapshot(snap, seq, num_new_tokens=1):
        raise RuntimeError(f"cannot import request {rid!r} now: its {snap.num_computed_tokens} tokens "
                           f"of KV and its state do not fit the free pools ({mgr.stats()})")
    return RequestGroup(rid, st["prompt"], params, [seq]), holds
