"""Falcon-H1: attention and a Mamba2 mixer side by side in EVERY decoder layer, with muP multipliers.

One layer keeps both a KV cache and a recurrent state, so it declares two cache entries under two
keys (the memory manager keys pools by int and gives the ints no meaning):

    key i                   -> AttentionSpec of layer i's `self_attn`  (caches.kv[i])
    key num_hidden_layers+i -> RecurrentSpec of layer i's `mamba`      (caches.conv / caches.state)

Multipliers, as transformers' FalconH1ForCausalLM applies them: embedding_multiplier on the
embeddings; attention_in / attention_out around attention; key_multiplier on K (folded into the
attention scale here: q . (m k) * s == q . k * (m s), so the cache holds unscaled K);
ssm_in / ssm_out around the mixer and ssm_multipliers on the sections of its in_proj output;
mlp_multipliers on the gate and down projections; lm_head_multiplier on the logits.
"""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.specs import LayerSpec

from .attention import PagedAttention
from .base import HybridModel
from .forward_batch import ForwardBatch, ModelCaches
from .mamba2_mixer import Mamba2Mixer
from .mlp import GatedMLP
from .norms import RMSNorm
from .rotary import RotaryEmbedding
from .slot_split import SlotSplit, split_decode_prefill

ARCHITECTURE = "FalconH1ForCausalLM"


def tiny_config(**overrides):
    """A 3-layer FalconH1Config with every multiplier away from 1 and chunk size 8 (to exercise chunking)."""
    from transformers import FalconH1Config

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=96, mamba_n_heads=6,
              mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=8,
              mamba_rms_norm=True, mamba_norm_before_gate=True, max_position_embeddings=512,
              rms_norm_eps=1e-5, initializer_range=0.1, embedding_multiplier=1.7,
              attention_in_multiplier=0.8, attention_out_multiplier=1.3, key_multiplier=0.6,
              ssm_in_multiplier=1.25, ssm_out_multiplier=0.7,
              ssm_multipliers=[0.9, 1.2, 0.8, 1.1, 0.75], mlp_multipliers=[1.15, 0.85],
              lm_head_multiplier=0.9, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, architectures=[ARCHITECTURE])
    kw.update(overrides)
    return FalconH1Config(**kw)


class FalconH1MLP(GatedMLP):
    """x [T, hidden] -> down(up(x) * act(gate(x) * m_gate)) * m_down.

    (m_gate, m_down) = config.mlp_multipliers."""

    def __init__(self, config):
        super().__init__(config.hidden_size, config.intermediate_size, bias=config.mlp_bias,
                         act=config.hidden_act)
        self.gate_multiplier, self.down_multiplier = (float(m) for m in config.mlp_multipliers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.up_proj(x) * self.act_fn(self.gate_proj(x) * self.gate_multiplier)
        return self.rank_sum(self.down_proj(y) * self.down_multiplier)


class FalconH1DecoderLayer(nn.Module):
    """input_layernorm -> (mamba(x) * ssm_out + self_attn(x * attn_in) * attn_out) -> residual ->
    pre_ff_layernorm -> feed_forward -> residual. Module names are the checkpoint's."""

    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
        self.self_attn = PagedAttention(h, config.num_attention_heads, config.num_key_value_heads,
                                        head_dim, qkv_bias=config.attention_bias,
                                        o_bias=config.attention_bias,
                                        scale=head_dim ** -0.5 * config.key_multiplier)
        self.mamba = Mamba2Mixer(h, config.mamba_n_heads, config.mamba_d_head, config.mamba_n_groups,
                                 config.mamba_d_state, config.mamba_d_conv, config.mamba_chunk_size,
                                 eps=config.rms_norm_eps, conv_bias=config.mamba_conv_bias,
                                 proj_bias=config.mamba_proj_bias, activation=config.hidden_act,
                                 dt_limit=config.time_step_limit, out_bias=config.projectors_bias,
                                 gated_norm=config.mamba_rms_norm,
                                 norm_before_gate=config.mamba_norm_before_gate,
                                 in_multiplier=config.ssm_in_multiplier,
                                 zxbcdt_multipliers=config.ssm_multipliers)
        self.feed_forward = FalconH1MLP(config)
        self.input_layernorm = RMSNorm(h, eps=config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(h, eps=config.rms_norm_eps)
        self.attn_in = float(config.attention_in_multiplier)
        self.attn_out = float(config.attention_out_multiplier)
        self.ssm_out = float(config.ssm_out_multiplier)

    def forward(self, h: torch.Tensor, rope, batch: ForwardBatch, caches: ModelCaches, attn_key: int,
                mamba_key: int, split: SlotSplit) -> torch.Tensor:
        """h [T, H] residual stream -> [T, H]; KV at caches.kv[attn_key], state at caches.*[mamba_key]."""
        x = self.input_layernorm(h)
        m = self.mamba(x, batch, caches.conv[mamba_key], caches.state[mamba_key], split) * self.ssm_out
        a = self.self_attn(x * self.attn_in, rope, batch, caches.kv[attn_key]) * self.attn_out
        h = h + (m + a)
        return h + self.feed_forward(self.pre_ff_layernorm(h))


class _FalconH1Body(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(FalconH1DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class FalconH1Model(HybridModel):
    """Parameter names equal the HF checkpoint's (model.layers.N.mamba.in_proj.weight, ...)."""

    architecture = ARCHITECTURE

    def __init__(self, config):
        super().__init__(config)
        self.model = _FalconH1Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config, self.model.layers[0].self_attn.head_dim)
        self.embedding_multiplier = float(config.embedding_multiplier)
        self.lm_head_multiplier = float(config.lm_head_multiplier)

    def mamba_key(self, i: int) -> int:
        """The cache key of layer i's Mamba half (its attention half is keyed by i itself)."""
        return len(self.model.layers) + i

    def cache_specs(self) -> dict[int, LayerSpec]:
        # Each layer holds two caches: attention under key i, Mamba under num_hidden_layers + i.
        specs: dict[int, LayerSpec] = {}
        for i, layer in enumerate(self.model.layers):
            specs[i] = layer.self_attn.spec(self.dtype)
            specs[self.mamba_key(i)] = layer.mamba.cache_spec(self.dtype)
        return specs

    def _scaled_lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) * self.lm_head_multiplier

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        h = self.model.embed_tokens(batch.input_ids) * self.embedding_multiplier
        rope = self.rotary(batch.positions)
        split = split_decode_prefill(batch)  # one decode/prefill split shared by all mixers
        for i, layer in enumerate(self.model.layers):
            h = layer(h, rope, batch, caches, i, self.mamba_key(i), split)
        return self.compute_logits(self.model.final_layernorm(h), batch, self._scaled_lm_head)


MODEL_CLASS = FalconH1Model
