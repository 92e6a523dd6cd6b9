"""Jamba: Mamba1 layers with attention every `attn_layer_period` layers, MoE every `expert_layer_period`.

Layer i is attention when `i % attn_layer_period == attn_layer_offset` (else Mamba1), and its
feed-forward is a top-k MoE (no renormalisation) when `i % expert_layer_period ==
expert_layer_offset` (else a dense SwiGLU). Attention has no positional encoding: Mamba carries order.
"""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.specs import LayerSpec

from .attention import PagedAttention
from .base import HybridModel
from .decoder import HybridDecoderLayer, layer_cache_specs, run_layers
from .forward_batch import ForwardBatch, ModelCaches
from .mamba1_mixer import Mamba1Mixer
from .mlp import GatedMLP
from .moe import PerExpertView, SparseMoE
from .norms import RMSNorm

ARCHITECTURE = "JambaForCausalLM"


def tiny_config(**overrides):
    """A 4-layer JambaConfig: attention at layer 1, MoE (4 experts, top-2) at layers 1 and 3."""
    from transformers import JambaConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, attn_layer_period=4,
              attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=4,
              num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
              mamba_dt_rank=8, max_position_embeddings=512, rms_norm_eps=1e-5,
              initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, architectures=[ARCHITECTURE])
    kw.update(overrides)
    return JambaConfig(**kw)


def _is_attention(config, i: int) -> bool:
    return i % config.attn_layer_period == config.attn_layer_offset


def _is_moe(config, i: int) -> bool:
    return config.num_experts > 1 and i % config.expert_layer_period == config.expert_layer_offset


class JambaDecoderLayer(HybridDecoderLayer):
    """Pre-norm residual block: `self_attn` or `mamba` after `input_layernorm`, then
    `feed_forward` after `pre_ff_layernorm` (HF names)."""

    mixer_norm, recurrent = "input_layernorm", "mamba"  # the checkpoint's module names
    ff_norm, ff = "pre_ff_layernorm", "feed_forward"

    def __init__(self, config, i: int):
        super().__init__()
        h = config.hidden_size
        if _is_attention(config, i):
            head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
            self.self_attn = PagedAttention(h, config.num_attention_heads,
                                            config.num_key_value_heads, head_dim)
        else:
            self.mamba = Mamba1Mixer(h, config.mamba_d_state, config.mamba_d_conv,
                                     config.mamba_expand, config.mamba_dt_rank,
                                     eps=config.rms_norm_eps, conv_bias=config.mamba_conv_bias,
                                     proj_bias=config.mamba_proj_bias, activation=config.hidden_act)
        if _is_moe(config, i):
            self.feed_forward = SparseMoE(h, config.intermediate_size, config.num_experts,
                                          config.num_experts_per_tok, norm_topk_prob=False,
                                          act=config.hidden_act)
        else:
            self.feed_forward = GatedMLP(h, config.intermediate_size, act=config.hidden_act)
        self.input_layernorm = RMSNorm(h, eps=config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(h, eps=config.rms_norm_eps)


class _JambaBody(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(JambaDecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class JambaModel(HybridModel):
    """Parameter names equal the HF checkpoint's (model.layers.N.mamba.x_proj.weight,
    model.layers.N.feed_forward.router.weight, ...experts.E.gate_proj.weight)."""

    architecture = ARCHITECTURE

    def __init__(self, config):
        super().__init__(config)
        self.model = _JambaBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def load_weights(self, ckpt) -> None:
        """Per-expert checkpoints as published, or transformers' fused expert tensors."""
        super().load_weights(PerExpertView(ckpt))

    def cache_specs(self) -> dict[int, LayerSpec]:
        return layer_cache_specs(self.model.layers, self.dtype)

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        # no rope: attention has no positional encoding, Mamba carries order
        h = run_layers(self.model.layers, self.model.embed_tokens(batch.input_ids), None, batch, caches)
        return self.compute_logits(self.model.final_layernorm(h), batch, self.lm_head)


MODEL_CLASS = JambaModel
