"""The scheduler over the real manager, no model: queue order and FCFS, the burst hold, preemption
back to the queue, one token list per sequence, and a step whose cost does not grow with the queue."""
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from hybridkv.cache_manager import HybridCacheManager
from hybridkv.request import Request, RequestStatus
from hybridkv.sampling_params import SamplingParams
from hybridkv.scheduler.preemption import PreemptionPolicy
from hybridkv.scheduler.scheduler import Scheduler
from hybridkv.scheduler.sequence_queue import SequenceQueue

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_scheduler import BLOCK_SIZE, SPECS, step, step_times  # noqa: E402


def make(num_blocks: int, num_slots: int = 8, max_num_seqs: int = 8) -> Scheduler:
    mgr = HybridCacheManager(SPECS, BLOCK_SIZE, num_blocks, num_slots, fingerprint="test")
    return Scheduler(mgr, PreemptionPolicy("recompute", SPECS, BLOCK_SIZE, None, True), 2048, max_num_seqs)


def seq(rid: str, n: int, arrival: float, priority: int = 0, max_tokens: int = 8) -> Request:
    rng = random.Random(rid)  # its own tokens: no prefix shared with another test sequence
    return Request(rid, [rng.randrange(4, 30000) for _ in range(n)], SamplingParams(max_tokens=max_tokens),
                    priority=priority, arrival=arrival)


def scheduled(out) -> list[str]:
    return [c.seq.request_id for c in out.all_chunks()]


def advance(sched: Scheduler, out) -> None:
    """What the engine does after the forward pass: commit, checkpoint, append a sampled token."""
    for c in out.all_chunks():
        sched.mgr.commit(c.seq.request_id, c.num_tokens)
        if c.checkpoint:
            sched.mgr.prefix_cache.checkpoint(c.seq.request_id)
        if c.start + c.num_tokens == c.seq.num_tokens:
            c.seq.append_token(7)


def run_until_decoding(sched: Scheduler, *seqs: Request) -> None:
    while any(s.num_output_tokens == 0 for s in seqs):
        advance(sched, sched.schedule())


def test_queue_orders_by_priority_then_arrival_and_removes_by_id():
    q = SequenceQueue()
    a, b, c, d = seq("a", 4, 1.0), seq("b", 4, 2.0), seq("c", 4, 3.0, priority=-1), seq("d", 4, 2.0)
    for s in (a, b, c, d):
        q.add(s)
    assert list(q) == [c, a, b, d]  # d ties b on arrival: created later, runs later
    assert q.remove(a) and not q.remove(a) and a not in q and len(q) == 3
    assert q.peek() is c and q.pop() is c and q.peek() is b
    q.add(a)  # back in its place (a preempted sequence returns to the head)
    assert q.peek() is a and list(q) == [a, b, d]
    with pytest.raises(ValueError, match="already in this queue"):
        q.add(a)
    impostor = seq("b", 4, 0.0)  # same id, another object: not the queued one
    assert impostor not in q and not q.remove(impostor) and len(q) == 3


def test_queue_drops_stale_entries_and_keeps_order_under_churn():
    q = SequenceQueue()
    seqs = [seq(f"s{i}", 1, float(i)) for i in range(1000)]
    for s in seqs:
        q.add(s)
    for s in seqs[:-10]:  # remove from the middle and the head
        q.remove(s)
    assert len(q._heap) <= 2 * len(q) + 64  # stale entries are compacted away
    assert [s.request_id for s in q] == [f"s{i}" for i in range(990, 1000)]
    assert q.pop() is seqs[990] and len(q) == 9
    assert q.head(3) == seqs[991:994] and len(q) == 9 and q.head(50) == seqs[991:]  # left in place
    assert list(q) == seqs[991:]
    while q.peek() is not None:
        q.pop()
    assert len(q) == 0 and not q._heap


def test_fcfs_nobody_overtakes_a_head_that_does_not_fit():
    sched = make(num_blocks=10)
    a = seq("a", 100, 1.0, max_tokens=4)  # 7 of 10 blocks
    sched.add(a)
    run_until_decoding(sched, a)
    big, small = seq("big", 64, 2.0), seq("small", 16, 3.0)  # big needs 4 blocks, 3 are free
    sched.add(small)
    sched.add(big)
    out = sched.schedule()
    assert scheduled(out) == ["a"]  # small would fit, but big is first in line
    assert big in sched.waiting and small in sched.waiting and "small" not in sched.mgr.requests
    advance(sched, out)
    sched.finish(a, "length")
    assert scheduled(sched.schedule()) == ["big", "small"]


def test_a_request_held_for_a_shared_prefix_is_skipped_not_a_stop(monkeypatch):
    sched = make(num_blocks=40)
    asked = []

    def waits(req_id, token_ids, cache_salt=None):
        asked.append(req_id)
        return req_id == "held"

    monkeypatch.setattr(sched.mgr.prefix_cache, "waits_for_shared_prefix", waits)
    held, later = seq("held", 20, 1.0), seq("later", 20, 2.0)
    sched.add(held)
    sched.add(later)
    out = sched.schedule()
    assert scheduled(out) == ["later"]
    assert held in sched.waiting and held.status is RequestStatus.WAITING and "held" not in sched.mgr.requests
    assert sched.waiting.peek() is held  # still first in line
    advance(sched, out)
    monkeypatch.setattr(sched.mgr.prefix_cache, "waits_for_shared_prefix", lambda *a, **k: False)
    assert scheduled(sched.schedule()) == ["later", "held"]  # running prefill first, then the queue
    assert asked == ["held", "later"]


def test_the_burst_hold_scans_a_bounded_number_of_requests(monkeypatch):
    sched = make(num_blocks=40, max_num_seqs=4)
    calls = []
    monkeypatch.setattr(sched.mgr.prefix_cache, "waits_for_shared_prefix", lambda rid, *a, **k: calls.append(rid) or True)
    for i in range(100):
        sched.add(seq(f"w{i}", 20, float(i)))
    assert scheduled(sched.schedule()) == []
    assert len(calls) == 4 and len(sched.waiting) == 100  # held requests go back, in order
    assert [s.request_id for s in sched.waiting][:3] == ["w0", "w1", "w2"]


def test_a_preempted_request_returns_to_the_head_of_its_queue_and_is_not_held(monkeypatch):
    sched = make(num_blocks=6, num_slots=8)
    asked = []
    monkeypatch.setattr(sched.mgr.prefix_cache, "waits_for_shared_prefix", lambda rid, *a, **k: asked.append(rid) or False)
    a, b = seq("a", 48, 1.0, max_tokens=20), seq("b", 48, 2.0, max_tokens=20)  # 3 blocks each: all 6
    sched.add(a)
    sched.add(b)
    run_until_decoding(sched, a, b)
    assert sched.mgr.stats().kv_blocks_free == 0
    c = seq("c", 16, 3.0)
    sched.add(c)
    out = sched.schedule()  # a's decode needs a 4th block: b (latest arrival) is preempted
    assert scheduled(out) == ["a"] and [(s.request_id, m) for s, m in out.preempted] == [("b", "recompute")]
    assert sched.waiting.peek() is b and b.status is RequestStatus.WAITING and len(sched.running) == 1
    advance(sched, out)
    sched.finish(a, "length")
    asked.clear()
    assert scheduled(sched.schedule()) == ["b", "c"]
    assert asked == ["c"]  # the manager already knows b: a resume, never held for a burst


def test_the_scheduler_and_the_manager_hold_one_request_object():
    sched = make(num_blocks=20)
    a = seq("a", 20, 1.0)
    sched.add(a)
    run_until_decoding(sched, a)
    assert sched.mgr.request("a") is a and a.num_computed_tokens == 20
    a.append_token(42)
    assert sched.mgr.request("a").token_ids[-2:] == [7, 42] and a.num_tokens == 22
    assert a.output_token_ids == [7, 42] and a.prompt_token_ids == a.token_ids[:20]
    child = a.fork("a#1", 1)
    assert child.token_ids == a.token_ids and child.token_ids is not a.token_ids
    assert sched.mgr.fork("a", child)
    assert sched.mgr.request("a#1") is child and child.num_computed_tokens == a.num_computed_tokens


@pytest.mark.slow  # a subprocess
def test_migration_does_not_import_the_engine():
    code = ("import sys, hybridkv.scheduler.migration; "
            "print('hybridkv.scheduler.engine' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.slow  # long
def test_a_step_costs_the_same_with_20000_waiting_as_with_200():
    def cost(num_waiting: int) -> float:
        return min(statistics.median(step_times(num_waiting, steps=30, warmup=5, seed=r)) for r in range(3))

    shallow, deep = cost(200), cost(20_000)
    # before the id-keyed queues: ~38x (each step re-sorted the queue and removed by equality)
    assert deep < 5 * shallow, (deep, shallow)


def test_bench_step_runs_everyone_to_the_end():
    from bench_scheduler import build

    sched, _ = build(50, max_num_seqs=8, max_batched_tokens=256)
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        step(sched)
    assert not sched.has_unfinished()
    s = sched.mgr.stats()
    assert s.kv_blocks_used == 0 and s.slots_live == 0
