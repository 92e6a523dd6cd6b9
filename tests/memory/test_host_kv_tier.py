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
from tier_steps import evict_everything, run

BS = 4
ATTN = {0: AttentionSpec(2, 4, torch.float32), 1: AttentionSpec(1, 8, torch.float16)}
BLOCK_BYTES = BS * 2 * (2 * 4 * 4 + 1 * 8 * 2)  # per block: both layers' keys and values
HYBRID = {0: RecurrentSpec((3, 2), (2, 4), torch.float32), **{i + 1: s for i, s in ATTN.items()}}


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
    slot_bytes = probe.recurrent.store.slot_bytes
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


def _pinned_turn(m, prompt, seed):
    """A pinned turn (600 s) that computes `prompt` but its last token, then ends: its blocks' hashes."""
    from hybridkv.sampling_params import SamplingParams

    m.admit(Request(f"r{seed}", prompt, SamplingParams(max_tokens=1, cache_pin_ttl_s=600.0)))
    run(m, f"r{seed}", len(prompt) - 1, seed)
    m.finish(f"r{seed}")
    return m.prefix_cache.prompt_hashes(prompt, None)


def test_a_pinned_turns_blocks_go_to_the_host_pinned_and_come_back_pinned():
    """Pinned blocks the device must hand out go to the host KV tier WITH their pin (not a lost
    pin); there, later KV demotions pass them by; a hit promotes them back into device blocks that
    keep the pin."""
    m = HybridCacheManager(ATTN, BS, 6, 0, host_cache_bytes=4 * BLOCK_BYTES, fingerprint="f")
    prompt = list(range(1, 14))
    hashes = _pinned_turn(m, prompt, 1)
    pool, host = m.attention.pool, m.prefix_cache.host_kv
    evict_everything(m)  # every free block is taken: the 3 pinned ones last, demoted pinned
    assert all(host.entries[(None, h)].pinned_until > 0 for h in hashes) and pool.pins_reclaimed == 0
    pins = m.stats().pins
    assert pins["blocks"] == pins["blocks_on_host"] == 3 and pins["reclaimed_blocks"] == 0, pins
    evict_everything(m, seed=98)  # 6 more evicted blocks; room for one beside the pins
    assert tiers(m)["kv_entries"] == 4 and all((None, h) in host for h in hashes)
    assert m.admit(Request("again", prompt + [50])) == 12  # the whole prefix, from the host
    assert sorted(pool.pinned_until) == sorted(pool.cached[h] for h in hashes)  # the pin came back with them
    pins = m.stats().pins
    assert pins["blocks"] == 3 and pins["blocks_on_host"] == 0 and pins["reclaimed_blocks"] == 0, pins


def test_on_a_hybrid_only_a_swap_takes_a_pinned_host_block_counted():
    """A state demotion never evicts a pinned KV entry; a swapped request's bytes (a running
    request's memory) do, last, and each is counted as a lost pin."""
    probe = HybridCacheManager(HYBRID, BS, 6, 4, fingerprint="f")
    slot_bytes = probe.recurrent.store.slot_bytes
    m = HybridCacheManager(HYBRID, BS, 6, 4, host_cache_bytes=3 * BLOCK_BYTES + slot_bytes, fingerprint="f",
                           checkpoint_policy="none")
    hashes = _pinned_turn(m, list(range(1, 14)), 1)
    evict_everything(m)
    host = m.recurrent.host
    assert host.kv.pinned_entries() == 3 and host.kv._block_bytes[None] == BLOCK_BYTES
    assert host._victims(b"new", 4, 0, slot_bytes) == []  # a state fits beside the pins: no KV needed
    assert host._victims(b"new", 4, 0, slot_bytes + 1) is None  # but it never evicts a pinned block
    assert host.hold("swapped", 3 * BLOCK_BYTES + slot_bytes)  # a swap takes everything, the pins too
    assert not host.kv.entries and host.kv.pins_reclaimed == 3
    assert m.stats().pins["reclaimed_blocks"] == 3 and all(m.attention.pool.lookup(h) is None for h in hashes)
