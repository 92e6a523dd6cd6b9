"""Sliding-window KV through the coordinator: blocks leave with the window, hits need the window only."""
import pytest
import torch

from hybridkv.request import Request
from hybridkv.snapshot_transfer import request_of
from hybridkv.cache_manager import HybridCacheManager
from hybridkv.errors import MemoryBudgetError
from hybridkv.memory.full_attention import NO_BLOCK
from hybridkv.memory.sliding_window import SlidingWindowMemory
from hybridkv.specs import AttentionSpec, RecurrentSpec

BS, W = 4, 10
SW = {1: AttentionSpec(1, 2, torch.float32, sliding_window=W)}


def mgr(specs=SW, blocks=32, slots=0, **kw):
    return HybridCacheManager(specs, BS, blocks, slots, fingerprint="sw", **kw)


def run(m, rid, n, rng):
    slots = m.allocate(rid, n)
    assert slots is not None
    for t in m.kv_caches.values():
        for s in slots:
            t[s // BS, :, s % BS] = torch.randn(t.shape[1:2] + t.shape[3:], generator=rng)
    m.commit(rid, n)


def held(m, rid):
    return [b for b in m.block_ids(rid) if b != NO_BLOCK]


def test_long_generation_holds_at_most_the_window():
    m, rng = mgr(), torch.Generator().manual_seed(0)
    m.admit(Request("a", list(range(7))))
    run(m, "a", 7, rng)
    for t in range(100):  # decode: one token at a time
        m.append_tokens("a", [t % 50])
        run(m, "a", 1, rng)
        assert len(held(m, "a")) <= -(-W // BS) + 1
    r = m.request("a")
    first = m.block_ids("a").index(held(m, "a")[0])
    assert first * BS <= r.num_computed_tokens - W + 1  # every key the next token sees is held
    assert m.stats().kv_blocks_used == len(held(m, "a"))


def test_a_hit_needs_only_the_blocks_inside_the_window():
    m, rng = mgr(blocks=12), torch.Generator().manual_seed(1)
    prompt = list(range(40))
    m.admit(Request("a", prompt))
    run(m, "a", 40, rng)
    hashes = list(m.request("a").block_hashes)
    m.finish("a")  # all 10 blocks cached, 2 never used
    pool = m.attention.pool
    pool.release(pool.allocate(2 + 7))  # the 2 unused, then the 7 blocks that left the window first
    assert not any(h in pool.cached for h in hashes[:7]) and all(h in pool.cached for h in hashes[7:])
    again = prompt + [7]
    assert m.admit(Request("b", again)) == 40  # blocks 0-6 are gone; position 40 needs only [31, 40)
    assert m.block_ids("b")[:7] == [NO_BLOCK] * 7 and len(held(m, "b")) == 3


def test_export_import_moves_only_the_window_across_block_sizes():
    m, rng = mgr(), torch.Generator().manual_seed(2)
    m.admit(Request("a", list(range(30))))
    run(m, "a", 30, rng)
    snap = m.export_snapshot("a")
    assert snap.kv_start[1] == 20 and snap.kv[1].shape[1] == 10  # blocks 5.. of 4 tokens
    other = HybridCacheManager(SW, 3, 32, 0, fingerprint="sw")
    assert other.import_snapshot(snap, request_of(snap))
    got = other.export_snapshot("a")
    lo = 30 - W + 1  # the keys the next token attends to are identical
    assert torch.equal(got.kv[1][:, lo - got.kv_start[1]:], snap.kv[1][:, lo - snap.kv_start[1]:])


def test_sliding_window_with_recurrent_state_and_planning():
    specs = {0: RecurrentSpec((2, 2), (3,), torch.float32), **SW}
    m = HybridCacheManager.from_budget(specs, 1 << 16, BS, max_num_seqs=4, fingerprint="sw",
                                       max_num_batched_tokens=8)
    assert isinstance(m.attention, SlidingWindowMemory) and m.recurrent is not None
    assert m.attention._blocks_to_hold(10_000) == -(-(W - 1 + 8) // BS) + 1  # window + one chunk
    m.check_fits(5000, 5000)  # a long request fits: only its window is ever held


def test_a_group_without_blocks_is_refused_clearly():
    specs = {0: AttentionSpec(1, 2, torch.float32), 1: AttentionSpec(1, 2, torch.float32, sliding_window=8)}
    with pytest.raises(MemoryBudgetError, match="num_blocks=0 for the sliding-window 8 layers"):
        HybridCacheManager(specs, BS, {None: 8, 8: 0}, 0)
