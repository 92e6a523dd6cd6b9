"""Bamba: Mamba2 layers with full-attention layers at `attn_layer_indices`, SwiGLU feed-forward."""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.specs import LayerSpec

from .attention import PagedAttention
from .base import HybridModel
from .decoder import HybridDecoderLayer, layer_cache_specs, rotary_for, run_layers
from .forward_batch import ForwardBatch, ModelCaches
from .mamba2_mixer import Mamba2Mixer
from .mlp import GatedMLP
from .norms import RMSNorm

ARCHITECTURE = "BambaForCausalLM"


def tiny_config(**overrides):
    """A 4-layer BambaConfig (attention at layers 1 and 3), chunk size 8 to exercise chunking."""
    from transformers import BambaConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1, 3],
              mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16,
              mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, max_position_embeddings=512,
              rms_norm_eps=1e-5, initializer_range=0.1, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False, architectures=[ARCHITECTURE])
    kw.update(overrides)
    return BambaConfig(**kw)


def _is_attention(config, i: int) -> bool:
    return bool(config.attn_layer_indices) and i in config.attn_layer_indices


class BambaDecoderLayer(HybridDecoderLayer):
    """Pre-norm residual block: `self_attn` or `mamba` after `input_layernorm`, then
    `feed_forward` after `pre_ff_layernorm` (HF names)."""

    mixer_norm, recurrent = "input_layernorm", "mamba"  # the checkpoint's module names
    ff_norm, ff = "pre_ff_layernorm", "feed_forward"

    def __init__(self, config, i: int):
        super().__init__()
        h = config.hidden_size
        if _is_attention(config, i):
            head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
            self.self_attn = PagedAttention(h, config.num_attention_heads, config.num_key_value_heads,
                                            head_dim, qkv_bias=config.attention_bias,
                                            o_bias=config.attention_bias)
        else:
            self.mamba = Mamba2Mixer(h, config.mamba_n_heads, config.mamba_d_head,
                                     config.mamba_n_groups, config.mamba_d_state, config.mamba_d_conv,
                                     config.mamba_chunk_size, eps=config.rms_norm_eps,
                                     conv_bias=config.mamba_conv_bias,
                                     proj_bias=config.mamba_proj_bias, activation=config.hidden_act,
                                     dt_limit=config.time_step_limit)
        self.feed_forward = GatedMLP(h, config.intermediate_size, bias=config.mlp_bias,
                                     act=config.hidden_act)
        self.input_layernorm = RMSNorm(h, eps=config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(h, eps=config.rms_norm_eps)


class _BambaBody(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(BambaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class BambaModel(HybridModel):
    """Parameter names equal the HF checkpoint's (model.layers.N.mamba.in_proj.weight, ...)."""

    architecture = ARCHITECTURE

    def __init__(self, config):
        super().__init__(config)
        self.model = _BambaBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # partial_rotary_factor (0.5 for Bamba) comes from config.rope_parameters
        self.rotary = rotary_for(config, self.model.layers)

    def cache_specs(self) -> dict[int, LayerSpec]:
        return layer_cache_specs(self.model.layers, self.dtype)

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        body = self.model
        h = run_layers(body.layers, body.embed_tokens(batch.input_ids), self.rotary, batch, caches,
                       final_norm=body.final_layernorm)
        return self.compute_logits(h, batch, self.lm_head)


MODEL_CLASS = BambaModel
