"""Shared steps of the memory-tier tests (tests/memory/test_host_kv_tier.py, test_tier_reach.py,
test_disk_read_ahead.py): a model step that writes random KV and state, a request that computes a
prompt and keeps states, and a filler prompt that pushes every cached block off the device."""
import torch

from hybridkv.request import Request


def run(m, rid, n, seed):
    """A model step: random KV at the handed-out slots, random state in the live slot; commit."""
    g, bs = torch.Generator().manual_seed(seed), m.block_size
    slots = m.allocate(rid, n)
    assert slots is not None
    for t in m.kv_caches.values():
        for s in slots:
            t[s // bs, :, s % bs] = torch.randn(t.shape[1:2] + t.shape[3:], generator=g).to(t.dtype)
    if m.recurrent is not None:
        for t in list(m.conv_states.values()) + list(m.ssm_states.values()):
            t[m.live_slot(rid)] = torch.randn(t.shape[1:], generator=g).to(t.dtype)
    m.commit(rid, n)


def state_of(m, slot):
    return [t[slot].clone() for t in list(m.conv_states.values()) + list(m.ssm_states.values())]


def computed_with_states(m, prompt, seed, at=(12,)):
    """A request that computes `prompt` but its last token, keeping a state checkpoint at each
    position of `at`, then finishes: ({position: state}, its KV blocks {layer: [3 blocks]})."""
    rid, done, states = f"r{seed}", 0, {}
    m.admit(Request(rid, prompt))
    for p in sorted({*at, len(prompt) - 1}):
        if p > done:
            run(m, rid, p - done, seed + p)
            done = p
        if p in at:
            assert m.prefix_cache.checkpoint(rid)
            states[p] = state_of(m, m.live_slot(rid))
    kv = {i: t[m.block_ids(rid)[:3]].clone() for i, t in m.kv_caches.items()}
    m.finish(rid)
    return states, kv


def evict_everything(m, seed=99):
    """Another prompt takes every free block (the cached ones are evicted: to the host KV tier when
    there is one), then ends."""
    n = m.attention.pool.num_free * m.block_size
    m.admit(Request("filler", [seed] * n), num_new_tokens=n)
    run(m, "filler", n, seed)
    m.finish("filler")
