"""Migrate: move a live request, KV and state together, to another engine (DESIGN.md, migrate).

A mixin of Engine. `export_request` freezes a request into a `RequestSnapshot` (the manager's KV
of the computed tokens and the live slot, plus this engine's sampling state) and releases it
here; `import_request` continues it on another engine of the same model. A seeded sampler's
draws depend only on (seed, sequence index, step), so greedy and seeded outputs are identical to
never having moved. A request that holds no memory now (waiting, or preempted) moves as tokens.
"""
from __future__ import annotations

import dataclasses

from hybridkv.errors import SnapshotMismatchError
from hybridkv.request_state import RUNNING
from hybridkv.sampling_params import SamplingParams
from hybridkv.snapshot import RequestSnapshot

from .request import Request, RequestStatus


class MigrationMixin:
    def export_request(self, request_id: str) -> RequestSnapshot:
        """Freeze request `request_id` (n == 1) into a snapshot and release it from this engine."""
        g = self.groups.get(request_id)
        if g is None:
            raise KeyError(f"unknown request id {request_id!r}")
        if g.params.n != 1:
            raise ValueError(f"request {request_id!r} has n={g.params.n} sequences; only n == 1 "
                             "requests can migrate")
        seq = g.seqs[0]
        if seq.finished:
            raise ValueError(f"request {request_id!r} has finished; there is nothing to migrate")
        state = {"prompt": g.prompt, "num_prompt_tokens": len(g.prompt_token_ids),
                 "params": dataclasses.asdict(g.params), "priority": seq.priority,
                 "output_logprobs": [{str(k): v for k, v in d.items()} for d in seq.output_logprobs],
                 "num_cached_tokens": seq.num_cached_tokens}
        mr = self.mgr.requests.get(seq.request_id)
        if mr is not None and mr.status == RUNNING:
            snap = self.mgr.export_snapshot(seq.request_id, sampling_state=state)
        else:  # holds no memory here: the tokens are all it needs
            snap = RequestSnapshot(seq.request_id, list(seq.all_token_ids), len(g.prompt_token_ids), 0,
                                   g.params.max_tokens, {}, {}, {}, self.mgr.fingerprint,
                                   self.mgr.block_size, seq.cache_salt, sampling_state=state)
        self.groups.pop(request_id)
        self._release(seq, "migrated")
        self.counters["migrations_out"] += 1
        return snap

    def import_request(self, snap: RequestSnapshot) -> None:
        """Continue a migrated request here. Raises SnapshotMismatchError for another model, and
        RuntimeError when the pools cannot take its KV and state now."""
        if snap.fingerprint != self.mgr.fingerprint:
            raise SnapshotMismatchError(
                f"snapshot fingerprint {snap.fingerprint!r} != this engine's {self.mgr.fingerprint!r}: "
                "a request can only move between engines serving the same model and weights")
        st = snap.sampling_state
        rid = str(snap.req_id)
        if rid in self.groups:
            raise ValueError(f"request id {rid!r} is already in use on this engine")
        params = SamplingParams(**st["params"])
        n_prompt = st["num_prompt_tokens"]
        prompt_ids = list(snap.token_ids[:n_prompt])
        seq = Request(rid, rid, 0, prompt_ids, params, st["prompt"], st["priority"], snap.cache_salt)
        seq.output_token_ids = list(snap.token_ids[n_prompt:])
        seq.output_logprobs = [{int(k): v for k, v in d.items()} for d in st["output_logprobs"]]
        seq.num_cached_tokens = st["num_cached_tokens"]
        if snap.num_computed_tokens > 0:
            if not self.mgr.import_snapshot(snap, req_id=rid, num_new_tokens=1):
                raise RuntimeError(f"cannot import request {rid!r} now: its {snap.num_computed_tokens} "
                                   f"tokens of KV and its state do not fit the free pools ({self.mgr.stats()})")
            self.scheduler.add_running(seq)
        else:
            self.scheduler.add(seq)
        from .engine import Group

        self.groups[rid] = Group(rid, st["prompt"], prompt_ids, params, [seq])
        self.counters["migrations_in"] += 1
        assert seq.status in (RequestStatus.RUNNING, RequestStatus.WAITING)
