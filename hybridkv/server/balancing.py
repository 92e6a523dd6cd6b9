"""The data-parallel balancing policy: which replicas are relieved, where their requests go, and
which of a replica's requests may leave.

    balancer = Balancer()
    moved = balancer.look(probes, migrate)     # probes: {replica: ReplicaProbe}; every 50 ms
    seqs = requests_free_to_leave(llm, ours, waiting=True)   # inside a replica, on its engine thread
    p = probe(llm, token_ids, cache_salt)                      # a replica's ReplicaProbe (same thread)

A replica reads its queues through `LLM.queued()`, never the scheduler's own.

A replica is overloaded when requests wait behind a full batch, or waited at two looks in a row
(a one-step burst wait for a shared prefix does not count: moving would spoil it). It is relieved
in two ways. First its waiting requests that have nothing to gain there move as tokens to the
replicas with free seats (max_num_seqs minus running and waiting), most room first. Then, if
some still wait and a replica has nothing running or waiting, up to `waiting` of its running
requests move (KV and state) to the idle one. `migrate(a, b, k, waiting)` does a move and
says how many went; fewer than asked means the rest stay (they gain from staying).

A waiting request gains from staying when a cached prefix there serves it, or when a running
request there is computing its prefix (the burst rule: it waits for that leader's checkpoint,
and elsewhere it would recompute the prefix). Running requests leave most tokens left first.
"""
from __future__ import annotations

from typing import Callable, Collection

from .replica_messages import ReplicaProbe

Migrate = Callable[[int, int, int, bool], int]  # (from, to, how many, waiting ones) -> how many moved


class Balancer:
    """Decides, at each look, which replica sends how many requests to which (see the module)."""

    def __init__(self):
        self.waited: set[int] = set()  # replicas with requests waiting at the last look

    def look(self, probes: dict[int, ReplicaProbe], migrate: Migrate) -> int:
        """Relieve every overloaded replica among `probes` (the live ones) through `migrate`;
        returns how many requests moved."""
        alive = sorted(probes)
        room = {i: probes[i].max_num_seqs - probes[i].running - probes[i].waiting for i in alive}
        idle = [i for i in alive if probes[i].running == 0 and probes[i].waiting == 0]
        waited, self.waited = self.waited, {i for i in alive if probes[i].waiting}
        moved = 0
        for a in alive:
            pa = probes[a]
            if not pa.waiting or (pa.running < pa.max_num_seqs and a not in waited):
                continue
            left = pa.waiting
            for b in sorted((i for i in alive if i != a and room[i] > 0), key=lambda i: -room[i]):
                n = migrate(a, b, min(left, room[b]), True)
                left, room[b], moved = left - n, room[b] - n, moved + n
                if n and b in idle:
                    idle.remove(b)
                if not left or n == 0:  # all moved, or the rest gain from staying on a
                    break
            if left and idle:
                b = idle.pop(0)
                k = min(left, pa.running, probes[b].max_num_seqs)
                if k > 0:
                    moved += migrate(a, b, k, False)
        return moved


def requests_free_to_leave(llm, ours: Collection[str], waiting: bool) -> list:
    """The single-sequence requests of `llm` (ids in `ours`, not finished) that may leave it, in
    the order they should: waiting ones (`waiting`) that gain nothing by staying (no cached
    prefix here, no running leader here computing their prefix), or running ones, most tokens
    left first: `LLM.queued()` items (hybridkv/llm.py's QueuedRequest)."""
    mgr = llm.manager
    free = [q for q in llm.queued() if q.status == ("waiting" if waiting else "running")
            and isinstance(q.request_id, str) and q.request_id in ours and q.num_seqs == 1 and not q.finished]
    if waiting:
        return [q for q in free if mgr.prefix_cache.usable_tokens(q.token_ids, q.cache_salt) == 0
                and mgr.prefix_cache.bursts.leader_for(q.request_id, q.token_ids, q.cache_salt)[0] is None]
    return sorted(free, key=lambda q: -q.tokens_left)


def probe(llm, token_ids, cache_salt) -> ReplicaProbe:
    """`llm`'s answer to a probe: the usable cached prefix of `token_ids` (changes nothing) and its
    load, from `LLM.queued()` (swapped requests count as waiting)."""
    queued = llm.queued()
    running = sum(q.status == "running" for q in queued)
    return ReplicaProbe(llm.manager.prefix_cache.usable_tokens(token_ids, cache_salt),
                        sum(len(q.token_ids) for q in queued), running, len(queued) - running,
                        llm.config.max_num_seqs)
