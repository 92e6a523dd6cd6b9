"""BlockPool: tensors, refcounts, LRU free queue that keeps hashes, hash map."""
import random

import torch

from hybridkv.block_pool import BlockPool
from hybridkv.specs import AttentionSpec


def pool(n=6, bs=4):
    return BlockPool({3: AttentionSpec(2, 8, torch.float32), 7: AttentionSpec(1, 4, torch.float16)}, n, bs)


def test_tensors_shapes_dtypes():
    p = pool()
    assert p.kv[3].shape == (6, 2, 4, 2, 8) and p.kv[3].dtype == torch.float32
    assert p.kv[7].shape == (6, 2, 4, 1, 4) and p.kv[7].dtype == torch.float16


def test_allocate_release_refcounts_and_shortage():
    p = pool()
    a = p.allocate(4)
    assert len(set(a)) == 4 and all(p.refcount[b] == 1 for b in a) and p.num_free == 2
    assert p.allocate(3) is None and p.num_free == 2  # no partial allocation
    p.ref(a[:2])
    p.release(a)
    assert [p.refcount[b] for b in a] == [1, 1, 0, 0] and p.num_free == 4
    p.release(a[:2])
    assert p.num_free == 6 and all(r == 0 for r in p.refcount)


def test_freed_hashed_blocks_stay_findable_until_reused_lru():
    p = pool(n=4)
    a = p.allocate(4)
    for i, b in enumerate(a[:3]):
        p.set_hash(b, bytes([i]))
    p.release(a)  # a[3] unhashed goes first; hashed chain tail (a[2]) goes before its head
    assert p.lookup(b"\x00") == a[0] and p.num_cached_free == 3
    assert p.allocate(1) == [a[3]]
    assert p.allocate(1) == [a[2]] and p.lookup(b"\x02") is None
    p.ref([p.lookup(b"\x00")])  # a hit revives a free cached block
    assert p.refcount[a[0]] == 1 and a[0] not in p.free
    assert p.allocate(1) == [a[1]] and p.lookup(b"\x01") is None and p.num_free == 0


def test_duplicate_hash_takes_over_when_original_is_evicted():
    p = pool(n=3)
    a, b = p.allocate(2)
    p.set_hash(a, b"h")
    p.set_hash(b, b"h")
    assert p.lookup(b"h") == a
    p.release([a])
    p.allocate(2)  # evicts a (and the never-used block)
    assert p.lookup(b"h") is None
    p.release([b])
    assert p.lookup(b"h") == b


def test_copy_gather_scatter_roundtrip():
    p = pool()
    for t in p.kv.values():
        t.copy_(torch.randn(t.shape).to(t.dtype))
    p.copy_block(1, 5)
    for t in p.kv.values():
        assert torch.equal(t[1], t[5])
    out = p.gather([0, 2])
    assert out[3].shape == (2, 2, 4, 2, 8)
    p.scatter([4, 1], out)
    p.loads.settle()  # (each layer's write waits for its turn: hybridkv/layer_loads.py)
    for i, t in p.kv.items():
        assert torch.equal(t[4], t[0]) and torch.equal(t[1], t[2]) and torch.equal(out[i][0], t[0])


def test_prefix_tree_links_match_the_cached_blocks_under_random_use():
    """After any mix of allocate / set_hash (with its parent, or again without it, as a checkpoint
    re-registers a block) / ref / release, `children` is exactly what the cached blocks say:
    parent hash -> hashes of the cached blocks whose parent it is."""
    rng = random.Random(0)
    p = pool(n=8)
    held: list[int] = []
    names = [bytes([i]) for i in range(12)]
    for _ in range(3000):
        op = rng.random()
        if op < 0.25 and p.num_free:
            held += p.allocate(1)
        elif op < 0.55 and held:  # a block that just became full (a block's hash never changes)
            b, i = rng.choice(held), rng.randrange(12)
            if p.block_hash[b] is None:
                p.set_hash(b, names[i], names[i - 1] if i else b"")
        elif op < 0.7 and held:
            b = rng.choice(held)
            if p.block_hash[b] is not None:
                p.set_hash(b, p.block_hash[b])
                assert p.lookup(p.block_hash[b]) is not None  # it answers, unless a twin does
        elif op < 0.8 and held:
            b = rng.choice(held)
            p.ref([b])
            held.append(b)
        elif held:
            p.release([held.pop(rng.randrange(len(held)))])
        assert all(p.block_hash[b] == h for h, b in p.cached.items())
        want: dict = {}
        for h, b in p.cached.items():
            if p.parent[b] is not None:
                want.setdefault(p.parent[b], set()).add(h)
        assert p.children == want


def test_pinned_blocks_go_last_and_only_until_their_deadline(monkeypatch):
    """A pinned turn's free blocks (prefix_cache.pin) stay findable while unpinned free blocks
    are left to take; when a request needs more, the pins give way (counted); expired pins are
    ordinary LRU blocks again."""
    import hybridkv.block_pool as block_pool

    clock = [100.0]
    monkeypatch.setattr(block_pool.time, "monotonic", lambda: clock[0])
    p = pool()
    a = p.allocate(6)
    for i, b in enumerate(a):
        p.set_hash(b, bytes([i + 1]), bytes([i]) if i else b"")
    p.pin(a[:2], until=160.0)  # the LRU front's two blocks, pinned for 60 s
    p.release(a)
    taken = p.allocate(4)
    assert sorted(taken) == sorted(a[2:]) and p.lookup(b"\x01") == a[0] and p.lookup(b"\x02") == a[1]
    assert p.pins_reclaimed == 0
    p.release(taken)
    again = p.allocate(5)  # one more than the unpinned free blocks: a pin gives way, in LRU order
    assert a[1] in again and a[0] not in again and p.lookup(b"\x01") == a[0] and p.pins_reclaimed == 1
    p.release(again)
    clock[0] = 161.0  # past the deadline: a plain free block, taken in LRU order
    p.allocate(1)
    assert not p.pinned_until and p.pins_reclaimed == 1


def test_a_pinned_twin_let_go_after_another_block_answers_its_hash_passes_on_its_pin():
    """A pinned turn pins a held twin of a hash nobody answers (prefix_cache.pin). When another block
    answers the hash before the twin is let go, the twin goes unhashed at release and the answering
    block takes its pin: the hash stays findable until the deadline, ahead of unpinned blocks."""
    p = pool(n=4)
    first, twin = p.allocate(2)
    p.set_hash(first, b"h")
    p.set_hash(twin, b"h")  # a duplicate: `first` answers
    p.release([first])
    x, y, z = p.allocate(3)  # evicts `first`: nobody answers h now, the held twin still holds it
    assert first in (x, y, z) and p.lookup(b"h") is None
    p.pin([twin], until=1e12)  # (what a pinned turn's end does for its held twin)
    p.set_hash(x, b"h")  # another request computes the same block: x answers h
    p.set_hash(y, b"k")
    p.release([twin])  # the twin goes unhashed: x takes over its pin
    assert p.block_hash[twin] is None and p.lookup(b"h") == x and list(p.pinned_until) == [x]
    p.release([x])
    p.release([y, z])  # free, front to back: twin and z (unhashed), x, y
    p.allocate(3)
    assert p.lookup(b"h") == x and p.lookup(b"k") is None and p.pins_reclaimed == 0
