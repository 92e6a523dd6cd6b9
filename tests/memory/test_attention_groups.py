"""Several attention groups in one model (full attention, two windows) beside recurrent layers:
each group has its own pool and tables; every verb goes through every group; a refused call
changes nothing; the hit is what every group and the recurrent kind accept."""
import pytest
import torch

from hybridkv.request import Request, RequestStatus
from hybridkv.snapshot_transfer import request_of
from hybridkv.cache_manager import HybridCacheManager
from hybridkv.memory.full_attention import NO_BLOCK
from hybridkv.plan import plan, sliding_blocks_to_hold
from hybridkv.specs import AttentionSpec, RecurrentSpec

BS, W1, W2 = 4, 6, 10
MIXED = {0: AttentionSpec(2, 4, torch.float32), 1: AttentionSpec(1, 4, torch.float32, sliding_window=W1),
         2: RecurrentSpec((3, 2), (2, 4), torch.float32), 3: AttentionSpec(2, 2, torch.float32, sliding_window=W2),
         4: AttentionSpec(1, 8, torch.float32)}


def mgr(blocks=None, slots=6, **kw):
    kw.setdefault("fingerprint", "mixed")
    kw.setdefault("max_num_batched_tokens", 8)  # window groups then never need more than window + chunk
    return HybridCacheManager(MIXED, BS, blocks or {None: 40, W1: 12, W2: 16}, slots, **kw)


def step(m, rid, n, rng):
    """A model step: random KV at each group's own slots, random live state; commit."""
    start = m.request(rid).num_computed_tokens
    assert m.allocate(rid, n) is not None
    for group in m.attention_groups.values():
        for s in group.slot_mapping(rid, start, start + n):
            for t in group.pool.kv.values():
                t[s // BS, :, s % BS] = torch.randn(t.shape[1:2] + t.shape[3:], generator=rng)
    slot = m.live_slot(rid)
    for t in [*m.conv_states.values(), *m.ssm_states.values()]:
        t[slot] = torch.randn(t.shape[1:], generator=rng)
    m.commit(rid, n)


def held(m, w, rid):
    return [b for b in m.attention_groups[w].block_ids(rid) if b != NO_BLOCK]


def window_kv(m, rid):
    """{layer: [parts, tokens, h, d]} of the tokens each layer's next token attends to."""
    n, out = m.request(rid).num_computed_tokens, {}
    m.loads.settle()  # (writes from the host wait for each layer's turn: hybridkv/layer_loads.py)
    for group in m.attention_groups.values():
        ids = group.block_ids(rid)
        for p in range(group.first_needed_token(n), n):
            for i, t in group.pool.kv.items():
                out.setdefault(i, []).append(t[ids[p // BS], :, p % BS])
    return {i: torch.stack(v, 1) for i, v in out.items()}


def assert_conserved(m):
    """Per group: each block is free or referenced exactly as often as block tables name it."""
    for w, group in m.attention_groups.items():
        refs = {}
        for rid, r in m.requests.items():
            if r.status is RequestStatus.RUNNING:
                for b in held(m, w, rid):
                    refs[b] = refs.get(b, 0) + 1
        pool = group.pool
        assert all(pool.refcount[b] == n for b, n in refs.items()), w
        assert sum(1 for b in range(pool.num_blocks) if pool.refcount[b] > 0) == len(refs), w
        assert pool.num_free == pool.num_blocks - len(refs), w


def test_groups_are_separate_pools_and_tables():
    m = mgr()
    assert list(m.attention_groups) == [None, W1, W2] and m.attention is m.attention_groups[None]
    assert {i: t.shape[0] for i, t in m.kv_caches.items()} == {0: 40, 1: 12, 3: 16, 4: 40}
    assert sorted(m.attention_groups[W1].layers) == [1] and sorted(m.attention_groups[None].layers) == [0, 4]
    assert m.admit(Request("a", list(range(9)))) == 0
    step(m, "a", 9, torch.Generator().manual_seed(0))
    tables = m.block_tables(["a"])
    assert set(tables) == {None, W1, W2} and all(t.shape == (1, 3) for t in tables.values())
    assert all(tables[w][0].tolist() == [max(b, 0) for b in m.attention_groups[w].block_ids("a")] for w in tables)


def test_long_request_holds_only_windows_while_full_attention_grows():
    m, rng = mgr(), torch.Generator().manual_seed(1)
    m.admit(Request("a", list(range(7)), max_tokens=60))
    step(m, "a", 7, rng)
    for t in range(50):
        m.append_tokens("a", [t % 97])
        step(m, "a", 1, rng)
        n = m.request("a").num_computed_tokens
        assert len(held(m, None, "a")) == -(-n // BS)
        assert len(held(m, W1, "a")) <= -(-W1 // BS) + 1 and len(held(m, W2, "a")) <= -(-W2 // BS) + 1
        assert_conserved(m)
    m.finish("a")
    assert m.stats().kv_blocks_used == 0 and m.stats().slots_live == 0
    assert_conserved(m)


def test_refused_allocate_and_admit_change_nothing():
    rng = torch.Generator().manual_seed(2)
    m = mgr({None: 40, W1: 6, W2: 16})  # the small window's pool runs out first
    for rid, first in (("a", 30), ("b", 50)):
        m.admit(Request(rid, list(range(first, first + 8))))
        step(m, rid, 8, rng)  # each then holds two W1 blocks (the window of the 9th token: 3..8)
    assert m.attention_groups[W1].pool.num_free == 2 and m.attention_groups[None].pool.num_free == 36
    m.append_tokens("b", list(range(12)))
    before = ({w: (list(g.block_ids("b")), g.pool.num_free) for w, g in m.attention_groups.items()},
              m.live_slot("b"), m.stats())
    assert m.allocate("b", 12) is None  # W1 needs 3 more blocks, has 2; the full group has room
    after = ({w: (list(g.block_ids("b")), g.pool.num_free) for w, g in m.attention_groups.items()},
             m.live_slot("b"), m.stats())
    assert before == after
    assert m.admit(Request("c", list(range(70, 82)))) is None and "c" not in m.requests
    assert m.stats() == after[2]
    assert_conserved(m)


def test_hit_is_the_largest_position_every_group_accepts():
    rng = torch.Generator().manual_seed(3)
    m = mgr({None: 40, W1: 6, W2: 16}, checkpoint_policy="every_n_blocks", checkpoint_every_n=1)
    prompt = list(range(100, 125))  # 25 tokens: boundaries 4, 8, ..., 24
    m.admit(Request("a", prompt), num_new_tokens=4)  # chunks of 4: the small pool holds windows, not prompts
    for _ in range(6):
        step(m, "a", 4, rng)
        assert m.prefix_cache.checkpoint("a")
    step(m, "a", 1, rng)
    m.finish("a")
    assert m.admit(Request("b", prompt + [1]), num_new_tokens=2) == 24  # every group cached and a checkpoint at 24
    m.finish("b")
    # another request's blocks push a's old window blocks out of W1's small pool only
    m.admit(Request("x", list(range(200, 221))), num_new_tokens=4)
    for n in (4, 4, 4, 4, 4, 1):
        step(m, "x", n, rng)
    m.finish("x")
    hashes = m.prefix_cache.prompt_hashes(prompt, None)
    full, small = m.attention_groups[None], m.attention_groups[W1]
    assert full.usable_prefix(hashes, 6) == 6 and small.usable_prefix(hashes, 6) < 6
    hit = m.prefix_cache.usable_tokens(prompt + [1])
    assert hit == small.usable_prefix(hashes, 6) * BS  # checkpoints exist at every boundary
    assert m.admit(Request("c", prompt + [1]), num_new_tokens=4) == hit
    assert_conserved(m)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_goes_through_every_group(mode):
    rng = torch.Generator().manual_seed(4)
    m = mgr(checkpoint_policy="every_n_blocks", checkpoint_every_n=1)
    m.admit(Request("a", list(range(40))))
    for _ in range(5):
        step(m, "a", 4, rng)
        m.prefix_cache.checkpoint("a")
    kv = window_kv(m, "a")
    m.preempt("a", mode)
    assert m.stats().kv_blocks_used == 0 and all(g.block_ids("a") == [] for g in m.attention_groups.values())
    assert m.resume("a") == 20
    got = window_kv(m, "a")
    assert kv.keys() == got.keys() and all(torch.equal(kv[i], got[i]) for i in kv)
    assert_conserved(m)


def test_fork_export_import_and_discard_go_through_every_group():
    rng = torch.Generator().manual_seed(5)
    m = mgr()
    m.admit(Request("p", list(range(23))))
    step(m, "p", 23, rng)
    assert m.fork("p", m.request("p").fork("c"))
    assert all(held(m, w, "c") == held(m, w, "p") for w in m.attention_groups)
    assert_conserved(m)
    snap = m.export_snapshot("p")
    assert snap.kv_start == {1: 23 - W1 + 1 - (23 - W1 + 1) % BS, 3: 23 - W2 + 1 - (23 - W2 + 1) % BS}
    other = HybridCacheManager(MIXED, 8, {None: 20, W1: 6, W2: 8}, 4, fingerprint="mixed")
    assert other.import_snapshot(snap, request_of(snap, "q"))
    other.loads.settle()
    for w, g in other.attention_groups.items():  # the window's (or every) token, now in blocks of 8
        ids, n = g.block_ids("q"), 23
        for i, t in g.pool.kv.items():
            start = snap.kv_start.get(i, 0)
            for p in range(g.first_needed_token(n), n):
                assert torch.equal(t[ids[p // 8], :, p % 8], snap.kv[i][:, p - start]), (w, i, p)
    m.finish("c", discard=True)
    m.finish("p", discard=True)
    assert m.stats().kv_blocks_used == 0 and m.stats().slots_live == 0
    assert_conserved(m)


def test_plan_caps_sliding_groups_at_what_their_requests_hold():
    p = plan(MIXED, 1 << 20, BS, max_num_seqs=3, checkpoint_share=0.0, max_chunk_tokens=8)
    hold = {w: sliding_blocks_to_hold(w, BS, 8) for w in (W1, W2)}
    assert p.group_blocks[W1] == p.live_slots * hold[W1] and p.group_blocks[W2] == p.live_slots * hold[W2]
    assert p.group_blocks[None] == p.num_blocks > p.group_blocks[W2]
    assert p.total_bytes <= 1 << 20
    left = (1 << 20) - p.total_bytes
    assert left < p.group_bytes_per_block[None] + p.state_bytes_per_slot  # nothing big left unused
    m = HybridCacheManager.from_budget(MIXED, 1 << 20, BS, max_num_seqs=3, checkpoint_share=0.0,
                                       max_num_batched_tokens=8)
    assert {w: g.num_blocks for w, g in m.attention_groups.items()} == dict(p.group_blocks)
    m.check_fits(2000, 2000)  # a long request: its window groups hold only the window and a chunk
    unbounded = plan(MIXED, 1 << 20, BS, max_num_seqs=3, checkpoint_share=0.0)  # whole prompts: no cap
    assert len(set(unbounded.group_blocks.values())) == 1
