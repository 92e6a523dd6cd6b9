"""How deep the tiers together reach (hybridkv/memory/tier_reach.py), behind HybridCacheManager: the
data-parallel router's probe (`PrefixCache.usable_tokens`) sees a prefix held only in the host
tiers (KV and state) or only on disk, changes nothing (no counter, no LRU order, no file read), and
answers the depth the admission then hits; an admission takes a prefix whose blocks are split
between the host KV tier and the disk with its state in a third place, byte-exact; and a damaged
file in such a mix is refused, counted, and the hit falls back to a shallower position."""
import pytest
import torch

from hybridkv.cache_manager import HybridCacheManager
from hybridkv.request import Request
from hybridkv.specs import AttentionSpec, RecurrentSpec
from tier_steps import computed_with_states, evict_everything, state_of

BS = 4
HYBRID = {0: RecurrentSpec((3, 2), (2, 4), torch.float32), 1: AttentionSpec(2, 4, torch.float32),
          2: AttentionSpec(1, 8, torch.float16)}
PROMPT = list(range(1, 14))  # 3 full blocks before the last token
BIG = 1 << 20  # host bytes: room for every state and block these tests make


def snapshot(m):
    """What a read-only probe must leave as it is: every counter and each tier's LRU order."""
    host = m.recurrent.host
    return (m.stats(), list(host.entries), list(m.prefix_cache.host_kv.entries) if m.prefix_cache.host_kv else None,
            list(m.disk.store.names()) if m.disk else None, m.disk.store.stats() if m.disk else None)


def manager(tmp_path=None, **kw):
    return HybridCacheManager(HYBRID, BS, 6, 3, fingerprint="f", checkpoint_policy="none", host_cache_bytes=BIG,
                              disk_cache_dir=None if tmp_path is None else str(tmp_path), **kw)


def test_a_prefix_only_in_the_host_tiers_is_probed_without_a_change_and_then_hit():
    m = manager()
    states, kv = computed_with_states(m, PROMPT, 1)
    computed_with_states(m, list(range(30, 43)), 2)  # its checkpoint takes the last slot: the first state goes to the host
    evict_everything(m)  # and every KV block to the host KV tier
    hashes = m.prefix_cache.prompt_hashes(PROMPT, None)
    assert hashes[2] in m.recurrent.host and hashes[2] not in m.recurrent.checkpoints
    assert all((None, h) in m.prefix_cache.host_kv for h in hashes) and not m.attention.pool.lookup(hashes[0])
    before = snapshot(m)
    assert m.prefix_cache.usable_tokens(PROMPT + [50]) == 12
    assert snapshot(m) == before  # nothing counted, promoted or reordered
    assert m.admit(Request("again", PROMPT + [50])) == 12  # the admission hits what the probe announced
    m.loads.settle()  # (promoted blocks are written as each layer runs: hybridkv/layer_loads.py)
    assert all(torch.equal(m.kv_caches[i][m.block_ids("again")[:3]], kv[i]) for i in kv)
    assert all(torch.equal(a, b) for a, b in zip(state_of(m, m.live_slot("again")), states[12]))


def test_a_prefix_only_on_disk_is_probed_without_reading_a_file_and_then_hit(tmp_path):
    first = manager(tmp_path)
    states, kv = computed_with_states(first, PROMPT, 1)
    first.close()
    m = manager(tmp_path)
    before = snapshot(m)
    assert m.prefix_cache.usable_tokens(PROMPT + [50]) == 12
    assert snapshot(m) == before and m.disk.store.stats()["reads"] == 0
    assert m.admit(Request("again", PROMPT + [50])) == 12
    assert m.disk.store.stats()["reads"] == 4  # three KV blocks and the state
    m.loads.settle()  # (promoted blocks are written as each layer runs: hybridkv/layer_loads.py)
    assert all(torch.equal(m.kv_caches[i][m.block_ids("again")[:3]], kv[i]) for i in kv)
    assert all(torch.equal(a, b) for a, b in zip(state_of(m, m.live_slot("again")), states[12]))
    m.close()


def split(m, prompt, blocks: str, states: dict):
    """Leave each block of `prompt` in one lower tier (`blocks`: "H" host KV tier, "D" disk, one
    letter per block) and each state in one tier (states: {position: "device" | "host" | "disk"}),
    through the tiers' own verbs; the KV must be on the host and the disk when called."""
    hashes = m.prefix_cache.prompt_hashes(prompt, None)
    for i, where in enumerate(blocks):
        assert (None, hashes[i]) in m.prefix_cache.host_kv and m.disk.has_kv(None, i, hashes[i])
        if where == "H":
            m.disk.store.remove(m.disk.kv_name(None, i, hashes[i]))
        else:
            m.prefix_cache.host_kv.drop(None, hashes[i])
    for p, where in states.items():
        key = hashes[p // BS - 1]
        tier = "device" if key in m.recurrent.checkpoints else "host" if key in m.recurrent.host else None
        assert tier is not None and m.disk.has_state(key, p)
        if where == "disk":
            m.recurrent.store.invalidate(key)  # off the device and the host; the file stays
        else:
            assert where == tier, f"the state at {p} is on the {tier}, not the {where}"
            m.disk.store.remove(m.disk.state_name(key, p))
    m.disk.flush()


@pytest.mark.parametrize("blocks, state", [("HHD", "disk"), ("DHH", "host"), ("HDD", "device"), ("DDH", "disk")])
def test_a_hit_takes_blocks_from_the_host_and_the_disk_together(tmp_path, blocks, state):
    m = manager(tmp_path)
    states, kv = computed_with_states(m, PROMPT, 1)
    if state == "host":
        computed_with_states(m, list(range(30, 43)), 2)  # its checkpoint pushes the first state to the host
    evict_everything(m)
    m.disk.flush()
    split(m, PROMPT, blocks, {12: state})
    before = snapshot(m)
    assert m.prefix_cache.usable_tokens(PROMPT + [50]) == 12
    assert snapshot(m) == before
    assert m.admit(Request("again", PROMPT + [50])) == 12
    m.loads.settle()  # (promoted blocks are written as each layer runs: hybridkv/layer_loads.py)
    assert all(torch.equal(m.kv_caches[i][m.block_ids("again")[:3]], kv[i]) for i in kv)
    assert all(torch.equal(a, b) for a, b in zip(state_of(m, m.live_slot("again")), states[12]))
    host, disk = m.stats().tiers["host"], m.stats().tiers["disk"]
    assert host["kv_promotions"] == blocks.count("H") and disk["kv_promotions"] == blocks.count("D"), (host, disk)
    assert disk["promotions"] == (state == "disk") and disk["refused_corrupt"] == 0
    m.finish("again")
    assert m.stats().kv_blocks_used == 0 and m.stats().slots_live == 0  # nothing leaked
    m.close()


def test_a_damaged_file_in_a_mixed_hit_is_refused_and_a_shallower_position_taken(tmp_path):
    m = manager(tmp_path)
    states, kv = computed_with_states(m, PROMPT, 1, at=(8, 12))
    evict_everything(m)
    m.disk.flush()
    split(m, PROMPT, "HHD", {8: "host", 12: "disk"})
    hashes = m.prefix_cache.prompt_hashes(PROMPT, None)
    path = tmp_path / m.disk.store.namespace / m.disk.kv_name(None, 2, hashes[2])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    assert m.prefix_cache.usable_tokens(PROMPT + [50]) == 12  # the probe reads no file
    assert m.admit(Request("again", PROMPT + [50])) == 8  # blocks 0-1 from the host, the state at 8
    disk = m.stats().tiers["disk"]
    assert disk["refused_corrupt"] == 1 and not path.exists() and not m.disk.has_kv(None, 2, hashes[2]), disk
    m.loads.settle()  # (promoted blocks are written as each layer runs: hybridkv/layer_loads.py)
    assert all(torch.equal(m.kv_caches[i][m.block_ids("again")[:2]], kv[i][:2]) for i in kv)
    assert all(torch.equal(a, b) for a, b in zip(state_of(m, m.live_slot("again")), states[8]))
    assert m.prefix_cache.usable_tokens(PROMPT + [50]) == 8  # the refused file is gone from the index
    m.finish("again")
    m.close()
