"""plan(): exact bytes per KV block and per state slot, checked against hand-computed numbers."""
import pytest
import torch

from hybridkv.errors import MemoryBudgetError
from hybridkv.plan import kv_bytes_per_block, kv_bytes_per_token, kv_cache_bytes, plan, state_bytes_per_slot
from hybridkv.specs import AttentionSpec, RecurrentSpec

GiB, KiB = 1 << 30, 1 << 10


def llama(layers, kv_heads=8, head_dim=128, dtype=torch.float16):
    return {i: AttentionSpec(kv_heads, head_dim, dtype) for i in range(layers)}


def bamba_9b(state_dtype=None):
    # ibm-ai-platform/Bamba-9B config.json: 32 layers, hidden 4096, attn_layer_indices [9, 18, 27],
    # 32 heads / 8 KV heads (head_dim 4096/32 = 128), Mamba2: mamba_n_heads 128, mamba_d_head 64,
    # mamba_n_groups 1, mamba_d_state 128, mamba_d_conv 4, mamba_expand 2 (d_inner 8192 = 128 x 64).
    # Conv runs over x, B and C: conv_dim = 8192 + 2 x 1 x 128 = 8448, window d_conv - 1 = 3.
    attn = AttentionSpec(8, 128, torch.bfloat16)
    mamba = RecurrentSpec((8448, 3), (128, 64, 128), torch.bfloat16, state_dtype)
    return {i: attn if i in (9, 18, 27) else mamba for i in range(32)}


def jamba_v01():
    # ai21labs/Jamba-v0.1 config.json (= transformers' JambaConfig defaults): 32 layers, hidden 4096,
    # attn_layer_period 8, attn_layer_offset 4 -> attention at 4, 12, 20, 28; 32 heads / 8 KV heads
    # (head_dim 128); Mamba1: mamba_expand 2 (d_inner 8192), mamba_d_state 16, mamba_d_conv 4.
    attn = AttentionSpec(8, 128, torch.bfloat16)
    mamba = RecurrentSpec((8192, 3), (8192, 16), torch.bfloat16)
    return {i: attn if i % 8 == 4 else mamba for i in range(32)}


def test_seed_formula_gqa8_fp16_b16_s16384():
    # 2 x L x 8 x 128 x 16384 x 16 x 2 bytes = L GiB. The issue quotes "Llama-3-70B ... 64 GiB", which is
    # the formula at L = 64; Llama-3-70B's config has num_hidden_layers = 80, giving 80 GiB.
    assert kv_cache_bytes(llama(64), seq_len=16384, batch_size=16) == 64 * GiB
    assert kv_cache_bytes(llama(80), seq_len=16384, batch_size=16) == 80 * GiB


def test_llama3_8b_is_128_kib_per_token_fp16():
    assert kv_bytes_per_token(llama(32)) == 128 * KiB
    assert kv_bytes_per_block(llama(32), 16) == 2 * 1024 * KiB


def test_bamba_9b_shapes():
    specs = bamba_9b()
    assert kv_bytes_per_token(specs) == 2 * 3 * 8 * 128 * 2  # 12 KiB
    per_layer = 8448 * 3 * 2 + 128 * 64 * 128 * 2
    assert state_bytes_per_slot(specs) == 29 * per_layer == 62_287_360
    # an fp32 SSM state (as some kernels keep it) doubles only the state part
    assert state_bytes_per_slot(bamba_9b(torch.float32)) == 29 * (8448 * 3 * 2 + 128 * 64 * 128 * 4)


def test_jamba_v01_shapes():
    specs = jamba_v01()
    assert kv_bytes_per_token(specs) == 2 * 4 * 8 * 128 * 2 == 16 * KiB
    assert state_bytes_per_slot(specs) == 28 * (8192 * 3 + 8192 * 16) * 2 == 8_716_288


def test_plan_splits_budget_exactly():
    specs = jamba_v01()
    budget = 8 * GiB
    p = plan(specs, budget, block_size=16, max_num_seqs=64, checkpoint_share=0.1)
    slot, block = 8_716_288, 16 * 16 * KiB
    assert p.kv_bytes_per_block == block and p.state_bytes_per_slot == slot
    assert p.checkpoint_slots == int(budget * 0.1) // slot
    assert p.live_slots == 64 and p.num_slots == 1 + 64 + p.checkpoint_slots
    assert p.num_blocks == (budget - p.num_slots * slot) // block
    assert 0 <= budget - p.total_bytes < block


def test_plan_small_budget_caps_live_slots_and_pure_kinds():
    specs = bamba_9b()
    slot, block = 62_287_360, 16 * 12 * KiB
    p = plan(specs, 4 * slot, block_size=16, max_num_seqs=256, checkpoint_share=0.0)
    assert p.live_slots == 2 and p.num_slots == 3  # 1 null + 2 live; the rest is blocks
    assert p.num_blocks == (4 * slot - 3 * slot) // block
    attn_only = plan(llama(32), GiB, block_size=16)
    assert (attn_only.num_slots, attn_only.num_blocks) == (0, GiB // (2 * 1024 * KiB))
    rec_only = plan({0: RecurrentSpec((4, 3), (4, 8), torch.float32)}, 1000, max_num_seqs=2, checkpoint_share=0.5)
    assert rec_only.num_blocks == 0 and rec_only.state_bytes_per_slot == 176
    assert rec_only.num_slots == 1000 // 176 and rec_only.live_slots == 2


def test_plan_errors_name_values_and_limits():
    with pytest.raises(MemoryBudgetError, match=r"1000 bytes.*need at least"):
        plan(jamba_v01(), 1000)
    with pytest.raises(MemoryBudgetError, match="block_size=0"):
        plan(llama(2), GiB, block_size=0)
    with pytest.raises(MemoryBudgetError, match="block_size=-4"):
        kv_bytes_per_block(llama(2), -4)


def test_kv_bytes_per_request_counts_only_the_window_of_sliding_layers():
    from hybridkv.plan import kv_bytes_per_request
    full = {0: AttentionSpec(2, 8, torch.float32)}
    window = {0: AttentionSpec(2, 8, torch.float32, sliding_window=40)}
    per_token = 2 * 2 * 8 * 4
    assert kv_bytes_per_request(full, 1000, 16) == 63 * 16 * per_token
    assert kv_bytes_per_request(window, 1000, 16) == (3 + 1) * 16 * per_token  # ceil(40 / 16) + 1 blocks
    assert kv_bytes_per_request(window, 20, 16) == 2 * 16 * per_token  # shorter than the window
