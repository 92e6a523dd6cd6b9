"""The balancing policy (server/balancing.py): which of a replica's requests may leave (a waiting
request that a running leader there is computing the prefix of stays: the burst rule), and which
replica sends how many to which (Balancer), against fake loads and a recording migrate."""
from __future__ import annotations

import random

import pytest

from hybridkv import LLM, SamplingParams
from hybridkv.server.balancing import Balancer, probe, requests_free_to_leave
from hybridkv.server.replica_messages import ReplicaProbe
from hybridkv.server.router import PrefixRouter


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 120) for _ in range(n)]


def test_a_follower_of_a_running_leader_stays_while_an_unrelated_waiting_request_may_leave(checkpoints):
    llm = LLM(str(checkpoints["plain"]), device="cpu", dtype="float32", block_size=16,
              memory_budget_bytes=8 << 20, max_num_seqs=4, max_num_batched_tokens=32)
    rng = random.Random(0)
    prefix, params = _ids(rng, 96), SamplingParams(max_tokens=2, temperature=0)
    llm.add_request(prefix + _ids(rng, 3), params, request_id="leader")
    llm.step()  # the leader computes the first 32 of its 96 shared tokens
    llm.add_request(prefix + _ids(rng, 3), params, request_id="follower")
    llm.add_request(_ids(rng, 40), params, request_id="stranger")
    llm.step()
    sched, mgr = llm.engine.scheduler, llm.manager
    assert [s.request_id for s in sched.running] == ["leader"]
    follower = next(s for s in sched.waiting if s.request_id == "follower")
    # no cached prefix serves the follower yet: only the burst rule keeps it here
    assert mgr.prefix_cache.usable_tokens(follower.token_ids, None) == 0
    assert mgr.prefix_cache.bursts.leader_for("follower", follower.token_ids, None)[0] == "leader"
    ours = {"leader", "follower", "stranger"}
    assert [s.request_id for s in requests_free_to_leave(llm, ours, waiting=True)] == ["stranger"]
    assert [s.request_id for s in requests_free_to_leave(llm, ours - {"stranger"}, waiting=True)] == []
    assert [s.request_id for s in requests_free_to_leave(llm, ours, waiting=False)] == ["leader"]
    # the replica's load report reads LLM.queued(), which agrees with the scheduler's queues
    queued = list(sched.running) + list(sched.waiting) + list(sched.swapped)
    assert [(q.request_id, q.status) for q in llm.queued()] == (
        [(s.request_id, "running") for s in sched.running] + [(s.request_id, "waiting") for s in sched.waiting]
        + [(s.request_id, "swapped") for s in sched.swapped])
    assert probe(llm, prefix, None) == ReplicaProbe(
        mgr.prefix_cache.usable_tokens(prefix, None), sum(len(s.token_ids) for s in queued), len(sched.running),
        len(sched.waiting) + len(sched.swapped), sched.max_seqs)
    llm.close()


def _probe(running: int, waiting: int, seats: int = 2) -> ReplicaProbe:
    return ReplicaProbe(hit_tokens=0, load_tokens=0, running=running, waiting=waiting, max_num_seqs=seats)


class _Recorder:
    """migrate(a, b, k, waiting): records the call, moves at most `allow[(a, waiting)]` (all by default)."""

    def __init__(self, allow: dict | None = None):
        self.calls, self.allow = [], allow or {}

    def __call__(self, a: int, b: int, k: int, waiting: bool) -> int:
        self.calls.append((a, b, k, waiting))
        return min(k, self.allow.get((a, waiting), k))


def test_a_one_look_wait_beside_free_seats_counts_only_at_the_second_look():
    b, rec = Balancer(), _Recorder()
    loads = {0: _probe(1, 1), 1: _probe(0, 0)}
    assert b.look(loads, rec) == 0 and rec.calls == []  # may be a one-step burst wait
    assert b.look(loads, rec) == 1 and rec.calls == [(0, 1, 1, True)]


def test_a_full_batch_with_a_queue_sends_waiting_ones_to_the_most_room_first():
    b, rec = Balancer(), _Recorder()
    loads = {0: _probe(4, 5, seats=4), 1: _probe(3, 0, seats=4), 2: _probe(1, 0, seats=4)}
    assert b.look(loads, rec) == 4
    assert rec.calls == [(0, 2, 3, True), (0, 1, 1, True)]


def test_waiting_ones_that_stay_for_their_prefix_stop_the_spread_and_running_ones_go_to_an_idle_replica():
    b = Balancer()
    rec = _Recorder(allow={(0, True): 0})  # every waiting one on 0 gains from staying
    loads = {0: _probe(2, 3), 1: _probe(0, 0), 2: _probe(1, 0)}
    moved = b.look(loads, rec)
    # one try for the waiting ones (most room: the idle 1), then up to `waiting` running ones to it
    assert rec.calls == [(0, 1, 2, True), (0, 1, 2, False)] and moved == 2


def test_nothing_moves_without_a_queue_or_without_room():
    b, rec = Balancer(), _Recorder()
    assert b.look({0: _probe(2, 0), 1: _probe(0, 0)}, rec) == 0
    assert b.look({0: _probe(2, 2), 1: _probe(2, 1)}, rec) == 0 and b.look({0: _probe(2, 2), 1: _probe(2, 1)}, rec) == 0
    assert rec.calls == []


def test_a_prompt_goes_to_the_replica_whose_disk_holds_its_prefix(checkpoints, tmp_path):
    """The probe sees the disk tier (memory/tier_reach.py): a replica restarted on a directory that
    holds a prompt's prefix answers its depth without reading a file, the router picks it over a
    less loaded replica that holds nothing, and the admission there hits exactly that depth."""
    kw = dict(device="cpu", dtype="float32", block_size=16, memory_budget_bytes=8 << 20, max_num_seqs=4)
    path, prompt = str(checkpoints["plain"]), _ids(random.Random(1), 52)
    params = SamplingParams(max_tokens=3, temperature=0)
    writer = LLM(path, disk_cache_dir=str(tmp_path), **kw)
    writer.generate([prompt], params, use_tqdm=False)
    writer.close()
    replicas = [LLM(path, **kw), LLM(path, disk_cache_dir=str(tmp_path), **kw)]
    asked = prompt + [7]
    hits = [probe(llm, asked, None).hit_tokens for llm in replicas]
    assert hits == [0, 48] and replicas[1].manager.disk.store.stats()["reads"] == 0
    router = PrefixRouter(2, 16)
    router.load = [0, 1000]  # the busier replica: only its prefix can win
    assert router.choose("r", asked, 3, None, hits) == 1
    out = replicas[1].generate([asked], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == hits[1]
    assert replicas[1].stats()["checkpoint_tiers"]["disk"]["hits"] == 1
    for llm in replicas:
        llm.close()
