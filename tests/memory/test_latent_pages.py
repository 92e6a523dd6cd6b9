"""Latent KV pages (AttentionSpec(latent=True), multi-head latent attention): one vector per token
in the pool, the planner's bytes, and the token-major form that swap and migration use."""
import torch

from hybridkv.block_pool import BlockPool
from hybridkv.kv_tokens import blocks_from_tokens, kv_tokens
from hybridkv.plan import kv_bytes_per_block
from hybridkv.specs import AttentionSpec

LATENT = AttentionSpec(1, 40, torch.float32, latent=True)  # kv_lora_rank 32 + rope 8
PER_HEAD = AttentionSpec(2, 8, torch.float32)


def test_pages_and_planner_bytes_are_the_latents():
    pool = BlockPool({0: LATENT, 1: PER_HEAD}, num_blocks=6, block_size=4)
    assert pool.kv[0].shape == (6, 1, 4, 1, 40) and pool.kv[1].shape == (6, 2, 4, 2, 8)
    assert LATENT.kv_parts == 1 and LATENT.bytes_per_token() == 40 * 4
    assert kv_bytes_per_block({0: LATENT}, 16) == 16 * 40 * 4
    assert kv_bytes_per_block({0: LATENT, 1: PER_HEAD}, 16) == 16 * (40 + 2 * 2 * 8) * 4


def test_token_major_round_trip_to_another_block_size():
    """Latents written into shuffled blocks come out token-major `[1, T, 1, 40]` and go back into
    blocks of another size unchanged (what swap-in and import do)."""
    gen = torch.Generator().manual_seed(0)
    pool = BlockPool({0: LATENT, 1: PER_HEAD}, num_blocks=8, block_size=4)
    for t in pool.kv.values():
        t.copy_(torch.randn(t.shape, generator=gen))
    blocks = [5, 2, 7]
    tokens = kv_tokens(pool, blocks, 10)
    assert tokens[0].shape == (1, 10, 1, 40) and tokens[1].shape == (2, 10, 2, 8)
    assert torch.equal(tokens[0][0, 4:8, 0], pool.kv[0][2, 0, :, 0])
    other = blocks_from_tokens(tokens, 8)
    assert other[0].shape == (2, 1, 8, 1, 40) and other[1].shape == (2, 2, 8, 2, 8)
    dst = BlockPool({0: LATENT, 1: PER_HEAD}, num_blocks=3, block_size=8)
    dst.scatter([2, 0], other)
    back = kv_tokens(dst, [2, 0], 10)
    for i in (0, 1):
        assert torch.equal(back[i], tokens[i])
    assert kv_tokens(pool, [], 0)[0].shape == (1, 0, 1, 40)
