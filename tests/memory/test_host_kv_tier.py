"""The host tier of KV blocks (hybridkv/memory/host_kv_tier.py) behind HybridCacheManager: a cached
block the device evicts is copied to the host with its bytes intact, a later prompt with that
prefix promotes it back (byte-exact, out of the host: one tier at a time), a corrupted entry is
refused and counted (the hit stops before it), the budget keeps the most recently evicted blocks, and on a hybrid the KV
entries give way to states and swaps within one budget."""
import pytest
import torch

from hybridkv.cache_manager import HybridCacheManager
from hybridkv.request import Request
from hybridkv.specs import AttentionSpec, RecurrentSpec

BS = 4
ATTN = {0: AttentionSpec(2, 4, torch.float32), 1: AttentionSpec(1, 8, torch.float16)}
BLOCK_BYTES = BS * 2 * (2 * 4 * 4 + 1 * 8 * 2)  # per block: both layers' keys and values
HYBRID = {0: RecurrentSpec((3, 2), (2, 4), torch.float32), **{i + 1: s for i, s in ATTN.items()}}


def run(m, rid, n, seed):
    """A model step: random KV at the handed-out slots, random state in the live slot; commit."""
    g = torch.Generator().manual_seed(seed)
    slots = m.allocate(rid, n)
    assert slots is not None
    for t in m.kv_caches.values():
        for s in slots:
            t[s // BS, :, s % BS] = torch.randn(t.shape[1:2] + t.shape[3:], generator=g).to(t.dtype)
    if m.recurrent is not None:
        for t in list(m.conv_states.values()) + list(m.ssm_states.values()):
            t[m.live_slot(rid)] = torch.randn(t.shape[1:], generator=g).to(t.dtype)
    m.commit(rid, n)


def kv_of(m, rid, n_blocks):
    return {i: t[m.block_ids(rid)[:n_blocks]].clone() for i, t in m.kv_caches.items()}


def computed(m, prompt, seed, checkpoint=False):
    """A request that computes `prompt` except its last token (then finishes): its KV blocks."""
    rid = f"r{seed}"
    m.admit(Request(rid, prompt))
    run(m, rid, len(prompt) - 1, seed)
    if checkpoint:
        assert m.prefix_cache.checkpoint(rid)
    kv = kv_of(m, rid, (len(prompt) - 1) // BS)
    m.finish(rid)
    return kv


def evict_everything(m, seed=99):
    """Another prompt that takes every free block (the cached ones are evicted), then ends."""
    n = m.attention.pool.num_free * BS
    m.admit(Request("filler", [seed] * n), num_new_tokens=n)
    run(m, "filler", n, seed)
    m.finish("filler")


def tiers(m):
    return m.stats().tiers["host"]


def test_evicted_blocks_go_to_the_host_and_a_hit_promotes_them_byte_exact():
    m = HybridCacheManager(ATTN, BS, 6, 0, host_cache_bytes=8 * BLOCK_BYTES, fingerprint="f")
    prompt = list(range(1, 14))  # 3 full blocks before the last token
    kv = computed(m, prompt, 1)
    evict_everything(m)
    t = tiers(m)
    assert t["kv_demotions"] >= 3 and t["kv_entries"] == t["kv_demotions"] and t["kv_bytes"] == t["kv_entries"] * BLOCK_BYTES
    assert m.attention.pool.lookup(m.prefix_cache.prompt_hashes(prompt, None)[0]) is None  # gone from the device
    assert m.admit(Request("again", prompt + [50])) == 12  # the whole prefix, from the host
    got = kv_of(m, "again", 3)
    assert all(torch.equal(got[i], kv[i]) for i in kv)
    t = tiers(m)
    assert t["kv_promotions"] == 3 and t["kv_entries"] == t["kv_demotions"] - 3, t  # moved: one tier at a time
    assert m.stats().prefix_hit_tokens == 12


def test_a_corrupted_host_block_is_refused_and_the_prefix_recomputed():
    m = HybridCacheManager(ATTN, BS, 6, 0, host_cache_bytes=8 * BLOCK_BYTES, fingerprint="f")
    prompt = list(range(1, 14))
    computed(m, prompt, 1)
    evict_everything(m)
    host = m.prefix_cache.host_kv
    second = m.prefix_cache.prompt_hashes(prompt, None)[1]
    host.entries[(None, second)].kv[0].view(-1)[3] += 1.0  # one value of block 1, CRC unchanged
    kv0 = {i: e.clone() for i, e in host.entries[(None, m.prefix_cache.prompt_hashes(prompt, None)[0])].kv.items()}
    assert m.admit(Request("again", prompt + [50])) == 4  # full attention needs every block: block 0 only
    assert tiers(m)["kv_refused_corrupt"] == 1 and (None, second) not in host and tiers(m)["kv_promotions"] == 1
    got = m.kv_caches[0][m.block_ids("again")[0]]
    assert torch.equal(got, kv0[0])


def test_the_budget_keeps_the_latest_evicted_blocks():
    m = HybridCacheManager(ATTN, BS, 6, 0, host_cache_bytes=2 * BLOCK_BYTES + 7, fingerprint="f")
    computed(m, list(range(1, 14)), 1)
    evict_everything(m)
    t = tiers(m)
    assert t["kv_entries"] == 2 and t["kv_bytes"] == 2 * BLOCK_BYTES <= t["budget_bytes"]


def test_on_a_hybrid_kv_gives_way_to_states_and_a_hit_needs_both():
    """One budget: the KV blocks use what states and swaps leave; a promotion deepens a hit only
    where a state checkpoint is (device or host) at the same position."""
    probe = HybridCacheManager(HYBRID, BS, 6, 4, fingerprint="f")
    slot_bytes = probe.recurrent._slot_bytes
    m = HybridCacheManager(HYBRID, BS, 6, 4, host_cache_bytes=4 * BLOCK_BYTES + slot_bytes, fingerprint="f",
                           checkpoint_policy="none")
    prompt = list(range(1, 14))
    computed(m, prompt, 1, checkpoint=True)  # a state checkpoint at 12 and its 3 blocks
    evict_everything(m)
    t = tiers(m)
    assert t["kv_entries"] >= 3, t
    assert m.admit(Request("again", prompt + [50])) == 12  # KV from the host, the state from the device
    assert tiers(m)["kv_promotions"] >= 1
    m.finish("again")
    host = m.recurrent.host
    assert host.hold("swapped", 4 * BLOCK_BYTES)  # a swap takes the room: KV entries give way first
    assert host.kv.used_bytes + host.used_bytes + host.swap_bytes <= host.budget_bytes
    host.let_go("swapped")
    other = list(range(30, 43))
    computed(m, other, 2)  # no state kept for this one: its evicted blocks alone deepen nothing
    evict_everything(m, seed=98)
    assert m.admit(Request("no-state", other + [50])) == 0
