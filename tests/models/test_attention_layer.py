"""The paged attention layer's options against transformers' attention modules, through the pool.

Qwen3: GQA, qkv+o bias, per-head q/k RMSNorm, sliding window. Qwen3-Next: output gate,
zero-centered q/k norm, partial rotary (0.25). The sequence runs in two chunks over shuffled blocks.
"""
import pytest
import torch

from hybridkv.models.attention import PagedAttention
from hybridkv.models.forward_batch import ForwardBatch
from hybridkv.models.norms import RMSNorm
from hybridkv.models.rotary import RotaryEmbedding

T, BS, CHUNK = 21, 4, 8


def _hf_layer(kind):
    if kind == "qwen3_sliding":
        from transformers import Qwen3Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding

        cfg = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          attention_bias=True, num_hidden_layers=1, use_sliding_window=True,
                          sliding_window=6, layer_types=["sliding_attention"])
        cfg._attn_implementation = "eager"
        ours = PagedAttention(64, 4, 2, 16, qkv_bias=True, o_bias=True, sliding_window=6,
                              qk_norm=lambda d: RMSNorm(d, eps=cfg.rms_norm_eps))
        return cfg, Qwen3Attention(cfg, 0), Qwen3RotaryEmbedding(cfg), ours, 6
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import (Qwen3NextAttention,
                                                                    Qwen3NextRotaryEmbedding)

    cfg = Qwen3NextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, num_hidden_layers=1)
    cfg._attn_implementation = "eager"
    ours = PagedAttention(64, 4, 2, 16, output_gate=True,
                          qk_norm=lambda d: RMSNorm(d, eps=cfg.rms_norm_eps, zero_centered=True))
    return cfg, Qwen3NextAttention(cfg, 0), Qwen3NextRotaryEmbedding(cfg), ours, None


@pytest.mark.parametrize("kind", ["qwen3_sliding", "qwen3_next_gated"])
def test_layer_matches_transformers(kind):
    torch.manual_seed(0)
    cfg, hf, hf_rope, ours, window = _hf_layer(kind)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.15))
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(T, 64)
    pos = torch.arange(T)

    i, j = pos[:, None], pos[None, :]
    visible = (j <= i) & ((i - j < window) if window else True)
    mask = torch.zeros(T, T).masked_fill(~visible, float("-inf"))[None, None]
    with torch.no_grad():
        ref = hf(x[None], position_embeddings=hf_rope(x[None], pos[None]), attention_mask=mask)[0][0]

    rope = RotaryEmbedding(cfg, 16)
    kv = torch.randn(12, 2, BS, 2, 16)  # garbage everywhere the layer has not written
    blocks = torch.randperm(12)[: -(-T // BS)].to(torch.int32)
    outs = []
    for a, b in ((0, CHUNK), (CHUNK, T)):
        p = pos[a:b]
        batch = ForwardBatch(
            input_ids=p, positions=p, query_start_loc=torch.tensor([0, b - a], dtype=torch.int32),
            seq_lens=torch.tensor([b], dtype=torch.int32), block_table=blocks[None],
            slot_mapping=(blocks[p // BS].long() * BS + p % BS), state_slots=torch.zeros(1, dtype=torch.int32),
            has_initial_state=torch.tensor([a > 0]), query_lens_cpu=[b - a], seq_lens_cpu=[b])
        with torch.no_grad():
            outs.append(ours(x[a:b], rope(p), batch, kv))
    torch.testing.assert_close(torch.cat(outs), ref, rtol=1e-5, atol=1e-5)
