"""Chained block hashes: a prefix's identity, with the extra key that keeps tenants apart."""
import hashlib
import random

import numpy as np

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


def test_hashes_follow_the_documented_chain():
    """h_i = sha256(h_{i-1} | extra key | block i's token ids as int64), h_{-1} = b"" (the bytes
    every stored hash was made from), for several block sizes and large token ids."""
    rng = random.Random(0)
    for bs in (1, 4, 16):
        tokens = [rng.randrange(1 << 40) for _ in range(5 * bs + 3)]
        key = extra_key("m", cache_salt="s")
        out = []
        extend_hashes(out, tokens, 5, key, bs)
        prev, want = b"", []
        for i in range(5):
            prev = hashlib.sha256(prev + key + np.asarray(tokens[i * bs:(i + 1) * bs], dtype=np.int64).tobytes()).digest()
            want.append(prev)
        assert out == want
