"""Chained block hashes: a prefix's identity, with the extra key that keeps tenants apart."""
from hybridkv.block_hash import extend_hashes, extra_key

BS = 4


def hashes(tokens, salt=None, fp="m"):
    out = []
    extend_hashes(out, tokens, len(tokens) // BS, extra_key(fp, cache_salt=salt), BS)
    return out


def test_hash_chain_and_extra_key():
    t = list(range(12))
    h = hashes(t)
    assert len(h) == 3 and hashes(t[:8]) == h[:2]
    assert hashes([99] + t[1:])[2] != h[2]  # a change in block 0 changes every later hash
    assert not set(hashes(t, salt="tenant-b")) & set(h)  # other tenants never collide
    assert not set(hashes(t, fp="other-model")) & set(h)


def test_extend_continues_an_existing_chain():
    t = list(range(20))
    part = hashes(t[:8])
    extend_hashes(part, t, 5, extra_key("m"), BS)
    assert part == hashes(t)
