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


@pytest.mark.slow  # interpreted Triton
@pytest.mark.parametrize("cache", ["int8", "fp8_e4m3"])
def test_decode_over_codes_takes_the_triton_column_as_the_c_one(cache, monkeypatch):
    """PagedAttention.forward_codes on the op's CUDA column (HYBRIDKV_BACKEND=triton: the Triton
    kernels, interpreted; new K/V written by write_kv_triton into pages made on the layer's device)
    writes the pool bytes the C column writes and returns its output within fp32 rounding (GQA, a
    window, ragged contexts over shuffled blocks)."""
    from hybridkv.cache_dtype import kv_layout
    from hybridkv.models.forward_batch import QuantizedPages

    torch.manual_seed(1)
    layer = PagedAttention(32, 4, 2, 16, sliding_window=7).eval()
    layout = kv_layout(cache, 16)
    lens = [5, 14, 1]
    blocks = torch.randperm(12).to(torch.int32)[:12].view(3, 4)  # each request's 4 blocks of 4
    pool = layout.encode(torch.randn(12, 2, BS, 2, 16) * torch.exp(torch.randn(12, 2, BS, 2, 1)))
    last = torch.tensor(lens) - 1
    slots = blocks.long().gather(1, (last // BS)[:, None])[:, 0] * BS + last % BS
    hidden = torch.randn(3, 32)
    got = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("HYBRIDKV_BACKEND", backend)
        batch = ForwardBatch(
            input_ids=last, positions=last, query_start_loc=torch.arange(4, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=blocks, slot_mapping=slots,
            state_slots=torch.zeros(3, dtype=torch.int32), has_initial_state=torch.ones(3, dtype=torch.bool),
            query_lens_cpu=[1, 1, 1], seq_lens_cpu=lens)
        p = pool.clone()
        with torch.no_grad():
            out = layer.forward_codes(hidden, None, batch, QuantizedPages(p, layout, blocks, slots))
        assert out is not None
        got[backend] = (out, p)
    assert torch.equal(got["triton"][1], got["torch"][1]) and not torch.equal(got["torch"][1], pool)
    torch.testing.assert_close(got["triton"][0], got["torch"][0], rtol=1e-5, atol=1e-5)
