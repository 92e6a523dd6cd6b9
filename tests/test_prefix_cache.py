"""Prefix cache: chained hashes with extra key, match rules, checkpoints, eviction, policies."""
import torch

from hybridkv.block_pool import BlockPool
from hybridkv.checkpoint_policy import CheckpointPolicy
from hybridkv.prefix_cache import MISS_NO_CHECKPOINT, MISS_NO_KV, PrefixCache, extend_hashes, extra_key
from hybridkv.specs import AttentionSpec, RecurrentSpec
from hybridkv.state_pool import CHECKPOINT, StatePool

BS = 4


def hashes(tokens, salt=None, fp="m"):
    out = []
    extend_hashes(out, tokens, len(tokens) // BS, extra_key(fp, cache_salt=salt), BS)
    return out


def make(n_blocks=8, n_slots=4, eviction="lru", attention=True, recurrent=True, saved=None):
    blocks = BlockPool({0: AttentionSpec(1, 2, torch.float32)} if attention else {}, n_blocks, BS)
    states = StatePool({1: RecurrentSpec((2, 3), (2, 2), torch.float32)} if recurrent else {}, n_slots)
    return PrefixCache(blocks, states, BS, has_attention=attention, has_recurrent=recurrent, eviction=eviction,
                       saved_flops=saved)


def cache_blocks(pc, hs):
    ids = pc.blocks.allocate(len(hs))
    for b, h in zip(ids, hs):
        pc.blocks.set_hash(b, h)
    return ids


def checkpoint(pc, h, pos):
    slot = pc.states.allocate(CHECKPOINT)
    pc.add(h, pos, slot)
    return slot


def test_hash_chain_and_extra_key():
    t = list(range(12))
    h = hashes(t)
    assert len(h) == 3 and hashes(t[:8]) == h[:2]
    assert hashes([99] + t[1:])[2] != h[2]  # a change in block 0 changes every later hash
    assert not set(hashes(t, salt="tenant-b")) & set(h)  # other tenants never collide
    assert not set(hashes(t, fp="other-model")) & set(h)


def test_match_needs_checkpoint_at_exactly_L_and_leaves_one_token():
    pc = make()
    t = list(range(16))
    hs = hashes(t)
    ids = cache_blocks(pc, hs)
    m = pc.match(hs, len(t))  # limit (16 - 1) // 4 = 3 blocks, never the whole prompt
    assert (m.hit_tokens, m.kv_match_tokens, m.miss) == (0, 12, MISS_NO_CHECKPOINT)
    slot = checkpoint(pc, hs[1], 8)
    m = pc.match(hs, len(t))
    assert (m.hit_tokens, m.blocks, m.checkpoint.slot) == (8, ids[:2], slot)
    checkpoint(pc, hs[3], 16)  # at the whole prompt: unusable for this prompt
    assert pc.match(hs, len(t)).hit_tokens == 8
    assert pc.match(hs, len(t) + 1).hit_tokens == 16
    assert pc.match(hashes([7] * 16), 16).miss == MISS_NO_KV


def test_attention_only_and_recurrent_only_matching():
    pc = make(recurrent=False)
    hs = hashes(list(range(10)))
    cache_blocks(pc, hs[:1])
    assert pc.match(hs, 10).hit_tokens == 4
    pr = make(attention=False)
    hs = hashes(list(range(10)))
    checkpoint(pr, hs[0], 4)
    assert pr.match(hs, 10).hit_tokens == 4 and pr.match(hs, 10).blocks == []


def test_take_slot_reclaims_unreachable_first_then_lru():
    pc = make(n_slots=4)  # 3 usable slots
    hs = hashes(list(range(12)))
    ids = cache_blocks(pc, hs)
    a, b, c = checkpoint(pc, hs[0], 4), checkpoint(pc, hs[1], 8), checkpoint(pc, hs[2], 12)
    pc.touch(hs[0])  # LRU order now b, c, a
    pc.blocks.release(ids)
    pc.blocks.allocate(pc.blocks.num_free - 3)  # the never-hashed free blocks go first
    pc.blocks.allocate(1)  # evicts the chain's tail: hs[2] -> checkpoint c unreachable
    assert pc.blocks.lookup(hs[2]) is None and pc.blocks.lookup(hs[1]) is not None
    assert pc.take_slot("live") == c and set(pc.checkpoints) == {hs[0], hs[1]}
    assert pc.take_slot("live") == b  # LRU
    assert pc.take_slot("live", protect=hs[0]) is None and hs[0] in pc.checkpoints


def test_flop_aware_eviction_prefers_short_prefixes():
    pc = make(n_slots=4, eviction="flop", saved=lambda p: float(p * p))
    hs = hashes(list(range(40)))
    cache_blocks(pc, hs[:8])
    long_old = checkpoint(pc, hs[7], 32)
    short_mid = checkpoint(pc, hs[0], 4)
    checkpoint(pc, hs[1], 8)
    # LRU would drop the oldest (32 tokens); FLOP-aware keeps it: it saves 64x the prefill of 4 tokens
    assert pc.take_slot("live") == short_mid and hs[7] in pc.checkpoints
    assert long_old in [c.slot for c in pc.checkpoints.values()]


def test_store_copies_and_dedups():
    pc = make()
    hs = hashes(list(range(8)))
    live = pc.states.allocate("live")
    pc.states.conv[1][live] = 3.0
    assert pc.store(hs[0], 4, live) and not pc.store(hs[0], 4, live)
    assert torch.equal(pc.states.conv[1][pc.checkpoints[hs[0]].slot], pc.states.conv[1][live])


def test_policies():
    assert CheckpointPolicy("none", 4).due(0, 100, 50, None) is None
    pe = CheckpointPolicy("prompt_end", 4)
    assert pe.due(0, 64, 50, None) == 48 and pe.due(0, 47, 50, None) is None and pe.due(48, 50, 50, None) is None
    # in generated tokens: the latest boundary (rolling, for the next turn of a chat)
    assert pe.due(48, 60, 50, None) == 60 and pe.due(63, 64, 50, None) == 64 and pe.due(64, 65, 50, None) is None
    assert pe.due(0, 16, 48, None) is None and pe.due(0, 44, 48, None) == 44  # (48 - 1) // 4 * 4
    ev = CheckpointPolicy("every_n_blocks", 4, every_n=2)
    assert ev.due(0, 20, 100, None) == 8 and ev.due(8, 20, 100, None) == 16 and ev.due(17, 20, 100, None) is None
    assert ev.due(23, 24, 100, None) == 24  # a decode step landing on a boundary
    bp = CheckpointPolicy("branch_points", 4)
    assert bp.due(0, 64, 50, 12) == 12 and bp.due(12, 64, 50, 12) == 48
