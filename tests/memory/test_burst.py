"""The burst rule through the coordinator: a shared prefix nobody has computed is computed once."""
import torch

from hybridkv.cache_manager import HybridCacheManager
from hybridkv.request import Request
from hybridkv.specs import AttentionSpec, RecurrentSpec

BS = 4
HYBRID = {0: RecurrentSpec((3, 2), (2, 4), torch.float32), 1: AttentionSpec(2, 4, torch.float32)}
SHARED = list(range(100, 120))  # 5 blocks nobody has computed


def mgr(specs=HYBRID, **kw):
    return HybridCacheManager(specs, BS, 64, 8, fingerprint="b", **kw)


def step(m, rid, n):
    """allocate + commit n tokens, checkpoint where the chunk was cut for one; returns the cut."""
    r = m.request(rid)
    start = r.num_computed_tokens
    due = m.prefix_cache.checkpoint_due(rid, start, start + n)
    end = due or start + n
    assert m.allocate(rid, end - start) is not None
    m.commit(rid, end - start)
    if due is not None:
        m.prefix_cache.checkpoint(rid)
    return end


def test_followers_wait_for_the_leaders_checkpoint_then_hit():
    m = mgr()
    a, b, c = SHARED + [1, 2, 3], SHARED + [4, 5, 6, 7, 8], SHARED + [9]
    m.prefix_cache.plan_bursts([("a", a, None), ("b", b, None), ("c", c, None)])
    assert m.admit(Request("a", a)) == 0
    assert m.prefix_cache.waits_for_shared_prefix("b", b) and m.prefix_cache.waits_for_shared_prefix("c", c)
    assert m.request("a").shared == [20]  # the deepest boundary they share
    assert step(m, "a", len(a)) == 20  # the leader's chunk is cut at the shared boundary
    assert not m.prefix_cache.waits_for_shared_prefix("b", b)
    assert m.admit(Request("b", b)) == 20 and m.admit(Request("c", c)) == 20
    assert m.stats().burst_waits == 2 and m.stats().prefix_hit_tokens == 40


def test_without_a_plan_the_leader_is_told_before_it_passes_the_boundary():
    m = mgr()
    a, b = SHARED + [1, 2], SHARED + [3, 4, 5]
    assert m.admit(Request("a", a), num_new_tokens=8) == 0
    step(m, "a", 8)
    assert m.prefix_cache.waits_for_shared_prefix("b", b) and 20 in m.request("a").shared
    assert step(m, "a", 100) == 20 and m.admit(Request("b", b)) == 20


def test_the_wait_ends_when_the_leader_is_preempted_or_finishes():
    for end in ("preempt", "finish"):
        m = mgr()
        a, b = SHARED + [1], SHARED + [2, 3]
        m.admit(Request("a", a), num_new_tokens=4)
        step(m, "a", 4)
        assert m.prefix_cache.waits_for_shared_prefix("b", b)
        m.preempt("a") if end == "preempt" else m.finish("a")
        assert not m.prefix_cache.waits_for_shared_prefix("b", b)


def test_no_wait_once_the_leader_passed_the_boundary_without_a_checkpoint():
    m = mgr(checkpoint_policy="none")
    a, b = SHARED + [1], SHARED + [2, 3]
    m.admit(Request("a", a))
    step(m, "a", len(a))
    assert not m.prefix_cache.waits_for_shared_prefix("b", b)


def test_pure_attention_followers_wait_for_the_blocks():
    m = mgr(specs={1: AttentionSpec(2, 4, torch.float32)})
    a, b = SHARED + [1], SHARED + [2, 3]
    m.prefix_cache.plan_bursts([("a", a, None), ("b", b, None)])
    m.admit(Request("a", a))
    assert m.prefix_cache.waits_for_shared_prefix("b", b)
    assert m.request("a").shared == []  # no state to checkpoint: the blocks are enough
    step(m, "a", len(a))
    assert m.admit(Request("b", b)) == 20


def test_other_tenants_never_wait_for_each_other():
    m = mgr()
    a, b = SHARED + [1], SHARED + [2, 3]
    m.admit(Request("a", a, cache_salt="t1"))
    assert not m.prefix_cache.waits_for_shared_prefix("b", b, cache_salt="t2")
