"""Qwen3-Next: gated-delta-net layers and gated full-attention layers (`config.layer_types`), MoE.

Norms are zero-centered (x / rms * (1 + w)), including the per-head q/k norms; attention emits an
output gate from q_proj and rotates only `partial_rotary_factor` of each head. Layer i's MLP is a
sparse MoE with a sigmoid-gated shared expert when i is not in `mlp_only_layers` and
`(i + 1) % decoder_sparse_step == 0`, else a dense SwiGLU.
"""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.specs import LayerSpec

from .attention import PagedAttention
from .base import HybridModel
from .decoder import HybridDecoderLayer, layer_cache_specs, rotary_for, run_layers
from .forward_batch import ForwardBatch, ModelCaches
from .gdn_mixer import GatedDeltaNetMixer
from .mlp import GatedMLP
from .moe import PerExpertView, SparseMoE, published_router_name
from .norms import RMSNorm
from .mtp_head import WithMtp

ARCHITECTURE = "Qwen3NextForCausalLM"
_LAYER_TYPES = ("linear_attention", "full_attention")


def tiny_config(**overrides):
    """A 4-layer Qwen3NextConfig: GDN, attention, GDN, attention; MoE (4 experts, top-2, shared
    expert) everywhere except the dense layer 2."""
    from transformers import Qwen3NextConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              layer_types=["linear_attention", "full_attention"] * 2,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
              decoder_sparse_step=1, mlp_only_layers=[2], norm_topk_prob=True,
              max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.1,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
              architectures=[ARCHITECTURE])
    kw.update(overrides)
    return Qwen3NextConfig(**kw)


def _is_moe(config, i: int) -> bool:
    return (i not in (config.mlp_only_layers or []) and config.num_experts > 0
            and (i + 1) % config.decoder_sparse_step == 0)


def _zero_centered(eps: float):
    return lambda dim: RMSNorm(dim, eps=eps, zero_centered=True)


class Qwen3NextDecoderLayer(HybridDecoderLayer):
    """Pre-norm residual block: `linear_attn` (GDN) or `self_attn` after `input_layernorm`, then
    `mlp` after `post_attention_layernorm` (HF names)."""

    mixer_norm, recurrent = "input_layernorm", "linear_attn"  # the checkpoint's module names
    ff_norm, ff = "post_attention_layernorm", "mlp"

    def __init__(self, config, i: int):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        kind = config.layer_types[i]
        if kind not in _LAYER_TYPES:
            raise ValueError(f"layer_types[{i}] is {kind!r}; Qwen3-Next layers are one of {_LAYER_TYPES}")
        if kind == "full_attention":
            head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
            self.self_attn = PagedAttention(h, config.num_attention_heads,
                                            config.num_key_value_heads, head_dim,
                                            qkv_bias=config.attention_bias,
                                            o_bias=config.attention_bias,
                                            qk_norm=_zero_centered(eps), output_gate=True)
        else:
            self.linear_attn = GatedDeltaNetMixer(h, config.linear_num_key_heads,
                                                  config.linear_num_value_heads,
                                                  config.linear_key_head_dim,
                                                  config.linear_value_head_dim,
                                                  config.linear_conv_kernel_dim, eps=eps,
                                                  activation=config.hidden_act)
        if _is_moe(config, i):
            self.mlp = SparseMoE(h, config.moe_intermediate_size, config.num_experts,
                                 config.num_experts_per_tok, config.norm_topk_prob,
                                 shared_intermediate_size=config.shared_expert_intermediate_size,
                                 act=config.hidden_act)
        else:
            self.mlp = GatedMLP(h, config.intermediate_size, act=config.hidden_act)
        self.input_layernorm = RMSNorm(h, eps=eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(h, eps=eps, zero_centered=True)


class _Qwen3NextBody(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3NextDecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, zero_centered=True)


class Qwen3NextModel(WithMtp, HybridModel):
    """Parameter names equal the HF checkpoint's, except the MoE router: ours `mlp.router`,
    the checkpoint's `mlp.gate` (mapped in `checkpoint_name`). The MTP weights (`mtp.*`) are
    loaded only when the engine drafts with them (`with_mtp`: models/mtp_head.py)."""

    architecture = ARCHITECTURE

    def __init__(self, config, with_mtp: bool = False):
        super().__init__(config)
        self.model = _Qwen3NextBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # partial_rotary_factor (0.25 by default) comes from config.rope_parameters
        self.rotary = rotary_for(config, self.model.layers)
        self.init_mtp(config, Qwen3NextDecoderLayer, with_mtp)

    def checkpoint_name(self, name: str) -> str | None:
        return published_router_name(name)

    def load_weights(self, ckpt) -> None:
        """Per-expert checkpoints as published, or transformers' fused expert tensors."""
        super().load_weights(PerExpertView(ckpt))

    def cache_specs(self) -> dict[int, LayerSpec]:
        return self.mtp_specs(layer_cache_specs(self.model.layers, self.dtype))

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        h = run_layers(self.model.layers, self.model.embed_tokens(batch.input_ids), self.rotary,
                       batch, caches)
        return self.compute_logits(self.keep_hidden(self.model.norm(h)), batch, self.lm_head)


MODEL_CLASS = Qwen3NextModel
