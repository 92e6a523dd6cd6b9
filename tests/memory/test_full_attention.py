"""FullAttentionMemory on its own: prefix runs, admission with revived blocks, CoW, swap, export."""
import torch

from hybridkv.block_hash import extend_hashes, extra_key
from hybridkv.memory.full_attention import FullAttentionMemory
from hybridkv.specs import AttentionSpec

BS = 4


def hashes(tokens):
    out = []
    extend_hashes(out, tokens, len(tokens) // BS, extra_key("m"), BS)
    return out


def make(n_blocks=8):
    return FullAttentionMemory({0: AttentionSpec(1, 2, torch.float32)}, BS, n_blocks)


def fill(mem, rid, hs, tokens, rng):
    """Admit rid with no hit, allocate and 'compute' every token with random KV, commit."""
    mem.admit(rid, hs, 0)
    mem.allocate(rid, 0, tokens)
    for t in mem.pool.kv.values():
        for s in mem.slot_mapping(rid, 0, tokens):
            t[s // BS, :, s % BS] = torch.randn(t.shape[1:2] + t.shape[3:], generator=rng)
    mem.commit(rid, hs, 0, tokens // BS, tokens)


def test_usable_prefix_is_the_run_of_cached_blocks_from_the_start():
    mem, rng = make(), torch.Generator().manual_seed(0)
    hs = hashes(list(range(16)))
    fill(mem, "a", hs[:2], 8, rng)
    assert mem.usable_prefix(hs, 4) == 2 and mem.usable_prefix(hs, 1) == 1
    assert mem.usable_prefix(hashes([9] * 16), 4) == 0
    mem.release("a")  # freed blocks keep their hash: still a prefix
    assert mem.usable_prefix(hs, 4) == 2 and mem.stats()["blocks_cached"] == 2


def test_admission_counts_revived_blocks_and_refuses_without_side_effects():
    mem, rng = make(n_blocks=3), torch.Generator().manual_seed(0)
    hs = hashes(list(range(12)))
    fill(mem, "a", hs[:2], 8, rng)
    mem.release("a")  # 2 cached free blocks + 1 never used
    assert mem.can_admit(hs, 2, 12)      # revives 2, needs 1 new: exactly 3
    assert not mem.can_admit(hs, 2, 13)  # needs 2 new
    before = (list(mem.pool.refcount), mem.pool.num_free)
    assert before == (list(mem.pool.refcount), mem.pool.num_free)
    mem.admit("b", hs, 2)
    assert mem.block_ids("b") == [mem.pool.cached[hs[0]], mem.pool.cached[hs[1]]]


def test_fork_then_write_copies_the_shared_partial_block():
    mem, rng = make(), torch.Generator().manual_seed(1)
    hs = hashes(list(range(8)))
    fill(mem, "p", hs, 6, rng)
    mem.fork("p", "c", 6)
    assert mem.block_ids("c") == mem.block_ids("p")
    assert mem.can_allocate("c", 6, 7)
    mem.allocate("c", 6, 7)
    assert mem.block_ids("c")[0] == mem.block_ids("p")[0] and mem.block_ids("c")[1] != mem.block_ids("p")[1]
    shared = mem.block_ids("p")[1]
    assert torch.equal(mem.pool.kv[0][mem.block_ids("c")[1]], mem.pool.kv[0][shared])


def test_swap_and_export_round_trip_across_block_sizes():
    mem, rng = make(), torch.Generator().manual_seed(2)
    hs = hashes(list(range(12)))
    fill(mem, "a", hs[:2], 10, rng)
    part = mem.export("a", 10, "cpu")
    copy = mem.swap_out("a", 10)
    assert mem.stats()["blocks_used"] == 0
    assert mem.can_swap_in(copy, 11)
    mem.swap_in("a", copy, hs[:2], 10)
    assert torch.equal(mem.export("a", 10, "cpu")["kv"][0], part["kv"][0])
    other = FullAttentionMemory({0: AttentionSpec(1, 2, torch.float32)}, 3, 8)
    assert other.can_import(part, 10, 10)
    other.import_("a", part, [], 10)
    assert torch.equal(other.export("a", 10, "cpu")["kv"][0], part["kv"][0])
