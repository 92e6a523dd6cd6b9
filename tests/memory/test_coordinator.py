"""HybridCacheManager scenarios: hits over both pools, copy-on-write, swap, migrate, errors, stats."""
import pytest
import torch

from hybridkv.request import Request
from hybridkv.snapshot_transfer import request_of
from hybridkv.cache_manager import HybridCacheManager
from hybridkv.errors import MemoryBudgetError, RequestStateError, RequestTooLargeError, SnapshotMismatchError
from hybridkv.specs import AttentionSpec, RecurrentSpec

BS = 4
HYBRID = {0: RecurrentSpec((3, 2), (2, 4), torch.float32), 1: AttentionSpec(2, 4, torch.float32),
          2: RecurrentSpec((3, 2), (2, 4), torch.float16, torch.float32), 3: AttentionSpec(1, 8, torch.float16)}


def mgr(specs=HYBRID, blocks=16, slots=4, **kw):
    kw.setdefault("fingerprint", "m1")
    return HybridCacheManager(specs, BS, blocks, slots, **kw)


def run(m, rid, n, rng=None):
    """A model step: random KV at the handed-out slots, random state in the live slot; commit."""
    slots = m.allocate(rid, n)
    assert slots is not None
    for t in m.kv_caches.values():
        for s in slots:
            t[s // BS, :, s % BS] = torch.randn(t.shape[1:2] + t.shape[3:], generator=rng).to(t.dtype)
    slot = m.live_slot(rid)
    for t in list(m.conv_states.values()) + list(m.ssm_states.values()):
        t[slot] = torch.randn(t.shape[1:], generator=rng).to(t.dtype)
    m.commit(rid, n)
    return slots


def kv_tokens(m, rid):
    n = m.request(rid).num_computed_tokens
    nb = -(-n // BS)
    return {i: t[m.block_ids(rid)[:nb]].permute(1, 0, 2, 3, 4).reshape(2, nb * BS, *t.shape[3:])[:, :n].clone()
            for i, t in m.kv_caches.items()}


def state(m, rid):
    s = m.live_slot(rid)
    return [t[s].clone() for t in list(m.conv_states.values()) + list(m.ssm_states.values())]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b)) if isinstance(a, list) else \
        a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_hybrid_hit_needs_checkpoint_and_copies_it():
    m = mgr()
    prompt = list(range(18))
    assert m.admit(Request("a", prompt)) == 0
    due = m.prefix_cache.checkpoint_due("a", 0, 18)
    assert due == 16  # prompt_end: (18 - 1) // 4 * 4
    run(m, "a", due)
    assert m.prefix_cache.checkpoint("a")
    at16 = state(m, "a")
    run(m, "a", 2)
    m.finish("a")
    assert m.admit(Request("b", prompt + [7])) == 16  # KV blocks and the checkpoint at exactly 16
    assert same(state(m, "b"), at16)  # copy-on-hit
    run(m, "b", 3)
    ckpt = next(iter(m.recurrent.checkpoints.values()))
    assert same([t[ckpt.slot] for t in list(m.conv_states.values()) + list(m.ssm_states.values())], at16)
    assert m.admit(Request("c", list(range(12)) + [50, 51, 52])) == 0  # KV matches 12 tokens, no checkpoint at 12
    s = m.stats()
    assert s.prefix_misses["kv_match_no_checkpoint"] == 1 and s.prefix_misses["no_kv_match"] == 1
    assert s.prefix_hit_tokens == 16 and s.prefix_queries == 3
    assert m.prefix_cache.checkpoint_due("c", 0, 15) == 12  # prompt_end of a 15-token prompt: (15 - 1) // 4 * 4


def test_branch_point_policy_cuts_where_kv_match_runs_past_checkpoints():
    m = mgr(checkpoint_policy="branch_points")
    run_all = list(range(30))
    m.admit(Request("a", run_all))
    run(m, "a", 29)
    m.finish("a")
    assert m.admit(Request("b", list(range(10)) + [99] * 10)) == 0
    assert m.request("b").branch_point == 8 and m.prefix_cache.checkpoint_due("b", 0, 20) == 8


def test_pure_attention_hit_never_covers_whole_prompt_and_salt_isolates():
    m = mgr({1: AttentionSpec(2, 4, torch.float32)}, slots=0)
    assert m.admit(Request("a", list(range(8)))) == 0 and m.live_slot("a") == 0
    run(m, "a", 8)
    m.finish("a")
    assert m.admit(Request("b", list(range(8)))) == 4  # two blocks cached, one token must stay to compute
    assert m.admit(Request("c", list(range(8)), cache_salt="other-tenant")) == 0
    assert m.block_table(["b", "c"]).shape == (2, 1)


def test_pure_recurrent_manager():
    m = mgr({0: RecurrentSpec((3, 2), (2, 4), torch.float32)}, blocks=0)
    assert m.admit(Request("a", list(range(10)))) == 0
    assert m.allocate("a", 8) == [-1] * 8
    m.commit("a", 8)
    assert m.prefix_cache.checkpoint("a")
    m.finish("a")
    assert m.admit(Request("b", list(range(10)))) == 8


def test_allocate_shortage_has_no_side_effects_and_evicts_cached_blocks_first():
    m = mgr(blocks=4)
    m.admit(Request("a", list(range(8))))
    run(m, "a", 8)
    m.finish("a")  # two cached free blocks
    m.admit(Request("b", [9] * 14), num_new_tokens=4)
    run(m, "b", 8)  # takes the 2 never-used blocks
    assert m.stats().kv_blocks_cached == 2
    run(m, "b", 4)  # evicts a cached block (LRU) rather than failing
    assert m.stats().kv_blocks_cached == 1
    table, free = list(m.block_ids("b")), m.attention.pool.num_free
    assert m.allocate("b", 6) is None  # needs 2 blocks, 1 is free
    assert m.block_ids("b") == table and m.attention.pool.num_free == free


def test_fork_shares_blocks_and_copies_partial_block_on_first_write():
    m = mgr()
    m.admit(Request("p", list(range(10))))
    run(m, "p", 10)
    assert m.fork("p", m.request("p").fork("c"))
    p, c = m.block_ids("p"), m.block_ids("c")
    assert c == p and all(m.attention.pool.refcount[b] == 2 for b in p)
    assert m.live_slot("c") != m.live_slot("p") and same(state(m, "c"), state(m, "p"))
    before = kv_tokens(m, "p")
    m.append_tokens("p", [1])
    m.append_tokens("c", [2])
    run(m, "c", 1)  # the partial block 2 is copied for the child before it writes
    assert c[:2] == p[:2] and c[2] != p[2]
    assert same(kv_tokens(m, "p"), before)  # the child's write does not show in the parent
    assert all(torch.equal(kv_tokens(m, "c")[i][:, :10], before[i]) for i in before)
    run(m, "p", 1)
    assert m.attention.pool.refcount[p[2]] == 1


def test_swap_roundtrip_restores_data_into_new_blocks():
    m = mgr(blocks=6)
    rng = torch.Generator().manual_seed(0)
    m.admit(Request("a", list(range(9))))
    run(m, "a", 9, rng)
    kv, st = kv_tokens(m, "a"), state(m, "a")
    m.preempt("a", "swap")
    assert m.stats().kv_blocks_used == 0 and m.stats().slots_live == 0
    m.admit(Request("x", [5] * 20), num_new_tokens=20)
    run(m, "x", 20)  # overwrites the old blocks
    assert m.resume("a") is None  # not now: 1 block free, 3 needed
    m.finish("x")
    assert m.resume("a") == 9
    assert same(kv_tokens(m, "a"), kv) and same(state(m, "a"), st)
    assert m.stats().preemptions == {"recompute": 0, "swap": 1}


def test_swap_is_held_by_the_host_budget_and_turns_recompute_when_it_cannot_be():
    """With a host tier, a swapped request's bytes count against host_cache_bytes from swap-out to
    swap-in (or its end); a swap the budget cannot hold preempts by recompute instead."""
    rng = torch.Generator().manual_seed(2)
    probe = mgr(blocks=12, slots=6)
    probe.admit(Request("a", list(range(9))))
    run(probe, "a", 9, rng)
    need = sum(k.swap_bytes("a", 9) for k in probe.kinds)
    assert need > 0
    m = mgr(blocks=12, slots=6, host_cache_bytes=need + need // 2)  # one swap fits, two do not
    for rid in "abc":
        m.admit(Request(rid, [ord(rid)] + list(range(8))))
        run(m, rid, 9, rng)
    kv, st = kv_tokens(m, "a"), state(m, "a")
    host = m.recurrent.host
    assert m.preempt("a", "swap") == "swap" and host.swap_bytes == need
    assert m.preempt("b", "swap") == "recompute"  # no room beside a's: recompute, nothing held
    assert m.request("b").status.value == "waiting" and m.request("b").num_computed_tokens == 0
    assert host.swap_bytes == need and host.stats()["swaps_refused"] == 1
    assert m.stats().preemptions == {"recompute": 1, "swap": 1}
    assert m.resume("a") == 9 and host.swap_bytes == 0  # back on the device: the host lets go
    assert same(kv_tokens(m, "a"), kv) and same(state(m, "a"), st)
    assert m.preempt("c", "swap") == "swap" and host.swap_bytes == need
    m.finish("c")  # ends while swapped: its host copy goes too
    assert host.swap_bytes == 0 and host.swapped == {}
    no_tier = mgr(blocks=12, slots=6)  # without a host tier swap is not bounded by a budget
    no_tier.admit(Request("a", list(range(9))))
    run(no_tier, "a", 9, rng)
    assert no_tier.preempt("a", "swap") == "swap"


def test_recompute_preemption_donates_state_at_block_boundary():
    m = mgr(checkpoint_policy="none")
    m.admit(Request("a", list(range(14))))
    run(m, "a", 12)
    st = state(m, "a")
    m.preempt("a", "recompute")
    assert m.stats().slots_checkpoint == 1 and m.stats().slots_live == 0
    assert m.resume("a") == 12 and same(state(m, "a"), st)


def test_export_import_into_manager_with_other_block_size():
    rng = torch.Generator().manual_seed(1)
    m = mgr()
    m.admit(Request("a", list(range(11)), max_tokens=5, cache_salt="t"))
    run(m, "a", 11, rng)
    snap = m.export_snapshot("a", sampling_state={"seed": 3})
    other = HybridCacheManager(HYBRID, 3, 20, 3, fingerprint="m1")
    assert other.import_snapshot(snap, request_of(snap))
    r = other.request("a")
    assert r.num_computed_tokens == 11 and len(other.block_ids("a")) == 4 and r.cache_salt == "t"
    for i, t in other.kv_caches.items():
        got = t[other.block_ids("a")].permute(1, 0, 2, 3, 4).reshape(2, 12, *t.shape[3:])[:, :11]
        assert torch.equal(got, kv_tokens(m, "a")[i])
    assert same(state(other, "a"), state(m, "a")) and snap.sampling_state == {"seed": 3}
    with pytest.raises(SnapshotMismatchError, match="'m1' != this model's 'm2'"):
        HybridCacheManager(HYBRID, 4, 8, 3, fingerprint="m2").import_snapshot(snap, request_of(snap))
    with pytest.raises(SnapshotMismatchError, match="layer"):
        HybridCacheManager({1: AttentionSpec(2, 4, torch.float32)}, 4, 8, 0, fingerprint="m1").import_snapshot(snap, request_of(snap))


def test_admission_errors_and_not_now():
    m = mgr(blocks=4, slots=2)
    with pytest.raises(RequestTooLargeError, match=r"15 prompt \+ 5 max_tokens needs 5 KV blocks.*pool has 4"):
        m.can_admit(Request(None, list(range(15)), max_tokens=5))
    with pytest.raises(RequestTooLargeError):
        m.admit(Request("big", list(range(17))))
    assert "big" not in m.requests
    m.admit(Request("a", list(range(4))))
    assert not m.can_admit(Request(None, list(range(4))))  # the one live slot is taken: not now
    assert m.admit(Request("b", list(range(4)))) is None and "b" not in m.requests
    with pytest.raises(RequestStateError, match="already known"):
        m.admit(Request("a", [1]))
    with pytest.raises(RequestStateError, match="not a block boundary"):
        run(m, "a", 3)
        m.prefix_cache.checkpoint("a")
    with pytest.raises(MemoryBudgetError, match="num_slots=1"):
        mgr(slots=1)
    with pytest.raises(MemoryBudgetError, match="block_size=0"):
        HybridCacheManager(HYBRID, 0, 4, 4)


def test_checkpoints_give_way_to_live_slots():
    m = mgr(slots=3)  # 2 usable slots
    m.admit(Request("a", list(range(9))))
    run(m, "a", 8)
    assert m.prefix_cache.checkpoint("a") and m.stats().slots_free == 0
    m.admit(Request("b", [7] * 9))  # no free slot: the checkpoint is evicted for a live request
    assert m.stats().slots_checkpoint == 0 and m.stats().slots_live == 2
    m.finish("b")
    m.finish("a")  # ends at 8, a block boundary: its live slot becomes the checkpoint (prompt_end)
    assert m.stats().slots_checkpoint == 1 and m.stats().slots_free == 1
    assert m.admit(Request("c", list(range(9)))) == 8 and m.stats().slots_checkpoint == 1
    assert m.admit(Request("d", [5] * 9)) == 0 and m.stats().slots_checkpoint == 0
    assert m.admit(Request("e", [4] * 9)) is None


def test_last_slot_checkpoint_becomes_the_live_slot():
    m = mgr(slots=2)  # a single usable slot
    m.admit(Request("a", list(range(9))))
    run(m, "a", 8)
    st = state(m, "a")
    m.finish("a")
    assert m.stats().slots_checkpoint == 1
    assert m.admit(Request("b", list(range(9)))) == 8  # no slot to copy into: the checkpoint is handed over
    assert same(state(m, "b"), st) and m.stats().slots_checkpoint == 0 and m.stats().slots_live == 1


def test_stats_and_block_table_and_from_budget():
    m = HybridCacheManager.from_budget(HYBRID, 40_000, block_size=BS, max_num_seqs=2, fingerprint="m1")
    p = m.memory_plan
    assert m.num_blocks == p.num_blocks > 0 and m.num_slots == p.num_slots
    assert p.total_bytes <= 40_000
    m.admit(Request("a", list(range(6))))
    run(m, "a", 6)
    m.admit(Request("b", list(range(100, 103))))
    run(m, "b", 3)
    s = m.stats()
    assert s.kv_blocks_used == 3 and s.slots_live == 2 and s.running_requests == 2
    assert s.fragmentation == pytest.approx((2 + 1) / (3 * BS))
    t = m.block_table(["b", "a"])
    assert t.dtype == torch.int32 and t.shape == (2, 2)
    assert t[0, 0].item() == m.block_ids("b")[0] and t[1].tolist() == m.block_ids("a")


def test_corrupt_snapshots_are_refused_before_anything_is_allocated():
    import dataclasses
    m = mgr()
    m.admit(Request("a", list(range(11)), max_tokens=5))
    run(m, "a", 11, torch.Generator().manual_seed(4))
    snap = m.export_snapshot("a")
    m.finish("a")
    before = m.stats()
    kv1 = dict(snap.kv)
    kv1[1] = kv1[1][:, :-1]  # KV missing its last token
    nan_state = {i: t.clone().fill_(float("nan")) for i, t in snap.ssm.items()}
    bad = [(dict(kv=kv1), "KV of layer 1 is"), (dict(kv={**snap.kv, 3: snap.kv[3].float()}), "expected"),
           (dict(ssm={i: torch.tensor(1.0) for i in snap.ssm}), "ssm state of layer"),
           (dict(ssm=nan_state), "NaN"), (dict(num_computed_tokens=snap.num_computed_tokens + 5), "inconsistent"),
           (dict(num_prompt_tokens=50), "inconsistent"), (dict(kv={}), "no KV for attention layer")]
    for change, msg in bad:
        with pytest.raises(SnapshotMismatchError, match=msg):
            m.import_snapshot(dataclasses.replace(snap, **change), request_of(dataclasses.replace(snap, **change)))
        assert m.stats() == before and "a" not in m.requests
    assert m.import_snapshot(snap, request_of(snap))


def test_discard_keeps_nothing_of_a_failed_step():
    m = mgr()
    m.admit(Request("a", list(range(18))))
    run(m, "a", 16)
    slots = m.allocate("a", 2)  # the step that fails: KV written past num_computed, never committed
    assert slots is not None
    before = m.stats()
    m.finish("a", discard=True)
    s = m.stats()
    assert "a" not in m.requests and s.kv_blocks_used == 0 and s.slots_live == 0
    assert s.slots_checkpoint == before.slots_checkpoint  # the advanced live state is not kept
    assert s.preemptions == {"recompute": 0, "swap": 0}
    assert m.admit(Request("b", list(range(18)))) == 0  # blocks 0-3 hashed before stay findable, no state at 16


def test_a_pinned_turn_pins_the_blocks_that_answer_its_hashes_whatever_the_policy():
    """Under checkpoint_policy 'none' (no final state kept) a pinned turn still pins its KV; where
    a twin answered a hash first, the twin is pinned (the turn's own block goes unhashed at release)."""
    from hybridkv.sampling_params import SamplingParams

    m = mgr(checkpoint_policy="none", blocks=16)
    pinned = SamplingParams(max_tokens=4, cache_pin_ttl_s=600.0)
    prompt = list(range(1, 10))  # 2 full blocks of 4 before the last token
    m.admit(Request("first", prompt, max_tokens=4))
    m.admit(Request("twin", prompt, pinned))  # admitted before "first" commits: computes the same blocks
    run(m, "first", 8)
    run(m, "twin", 8)
    pool, hashes = m.attention.pool, m.request("twin").block_hashes[:2]
    twin_blocks = m.block_ids("twin")[:2]
    assert [pool.cached[h] for h in hashes] == m.block_ids("first")[:2] != twin_blocks  # "first" answers
    m.finish("twin")
    assert sorted(pool.pinned_until) == sorted(pool.cached[h] for h in hashes)  # the answering blocks
    m.finish("first")
    assert all(pool.cached[h] in pool.pinned_until for h in hashes)
    assert m.stats().pins["blocks"] == 2



def test_a_pinned_turn_pins_the_blocks_of_its_states_that_left_its_sliding_window():
    """A sliding-window request lets go of the blocks that leave its window; they stay cached. A
    pinned turn pins the blocks that answer all its hashes, those included, so the states it kept
    at their boundaries (pinned too) keep their KV while other requests churn the pool."""
    from hybridkv.sampling_params import SamplingParams

    specs = {0: RecurrentSpec((3, 2), (2, 4), torch.float32), 1: AttentionSpec(2, 4, torch.float32, 4)}
    m = mgr(specs, blocks=8, slots=5, checkpoint_policy="none")
    a = Request("a", list(range(1, 14)), SamplingParams(max_tokens=1, cache_pin_ttl_s=600.0))
    m.admit(a)
    for _ in range(3):  # 12 tokens, a state kept at each block boundary
        run(m, "a", 4)
        assert m.prefix_cache.checkpoint("a")
    pool, hashes = m.attention.pool, a.block_hashes[:3]
    assert m.block_ids("a")[:2] == [-1, -1]  # blocks 0 and 1 left the window (cached, free)
    m.finish("a")
    assert sorted(pool.pinned_until) == sorted(pool.cached[h] for h in hashes)
    assert sorted(m.recurrent.pins.until) == sorted(hashes)
    m.admit(Request("b", list(range(100, 130))))
    for _ in range(7):  # takes 7 blocks, one at a time: only unpinned ones
        run(m, "b", 4)
    assert all(h in pool.cached and m.recurrent.store.reachable(h) and h in m.recurrent.checkpoints for h in hashes)
    assert m.stats().pins["reclaimed_blocks"] == 0
