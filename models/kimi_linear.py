"""Kimi-Linear: Kimi delta attention layers (state slots) and multi-head latent attention layers
(latent KV pages) per `config.layer_types`; a dense SwiGLU or a DeepSeek-V3-style MoE per
`config.mlp_layer_types` (sigmoid, group-limited top-k with score-correction bias, routed scaling,
shared experts). Pre-norm residual blocks; no rotary embedding anywhere.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from hybridkv.kernels import ops
from hybridkv.specs import LayerSpec

from .base import HybridModel
from .checkpoint import PartsView
from .decoder import HybridDecoderLayer, layer_cache_specs, run_layers
from .forward_batch import ForwardBatch, ModelCaches
from .kda_mixer import KimiDeltaAttentionMixer
from .latent_attention import LatentAttention
from .mixtral_names import MixtralExpertNames
from .mlp import GatedMLP
from .moe import PerExpertView, StackedExperts
from .nemotron_h import NemotronHRouter
from .norms import RMSNorm

ARCHITECTURE = "KimiLinearForCausalLM"
_LAYER_TYPES = ("linear_attention", "full_attention")
_MLP_TYPES = ("dense", "sparse")


def tiny_config(**overrides):
    """A 4-layer KimiLinearConfig: KDA, MLA, KDA, MLA; layer 0 dense, then MoE (4 experts in 2
    groups, top-2 from 1 group, a shared expert, routed scaling 2); MLA with a low-rank q path."""
    from transformers import KimiLinearConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
              layer_types=["linear_attention", "full_attention"] * 2,
              mlp_layer_types=["dense", "sparse", "sparse", "sparse"], linear_num_heads=2,
              linear_head_dim=16, linear_conv_kernel_dim=4, kv_lora_rank=32, q_lora_rank=24,
              qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_local_experts=4,
              num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.0,
              n_shared_experts=1, max_position_embeddings=512, rms_norm_eps=1e-5,
              initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, architectures=[ARCHITECTURE])
    kw.update(overrides)
    return KimiLinearConfig(**kw)


def _check_types(config) -> None:
    for name, values, allowed in (("layer_types", config.layer_types, _LAYER_TYPES),
                                  ("mlp_layer_types", config.mlp_layer_types, _MLP_TYPES)):
        for i, t in enumerate(values):
            if t not in allowed:
                raise ValueError(f"{name}[{i}] is {t!r}; Kimi-Linear layers are one of {allowed}")
    if getattr(config, "mla_use_nope", True) is not True:
        # transformers' Kimi-Linear applies no rotary to its latent attention whatever this says
        raise ValueError(f"config sets mla_use_nope={config.mla_use_nope!r}: only Kimi-Linear's "
                         f"rotary-free latent attention (mla_use_nope: true) is supported")
    if config.num_key_value_heads != config.num_attention_heads:
        raise ValueError(f"num_key_value_heads={config.num_key_value_heads} differs from "
                         f"num_attention_heads={config.num_attention_heads}; latent attention expands "
                         f"one key and value per head")


class KimiMoE(nn.Module):
    """hidden [T, H] -> [T, H]: DeepSeek-V3 routing (`gate`: weight, e_score_correction_bias) over
    stacked `experts`, plus `shared_experts` (a SwiGLU of moe_intermediate_size x n_shared)."""

    def __init__(self, config):
        super().__init__()
        h, n = config.hidden_size, config.num_local_experts
        self.gate = NemotronHRouter(SimpleNamespace(
            n_routed_experts=n, num_experts_per_tok=config.num_experts_per_tok,
            n_group=config.n_group, topk_group=config.topk_group, hidden_size=h,
            norm_topk_prob=config.norm_topk_prob, routed_scaling_factor=config.routed_scaling_factor))
        self.experts = StackedExperts(n, h, config.moe_intermediate_size)
        self.shared_experts = GatedMLP(h, config.moe_intermediate_size * config.n_shared_experts,
                                       act=config.hidden_act)
        self.act = config.hidden_act

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(hidden)
        out = ops.fused_moe(hidden, self.experts.gate_up_proj, self.experts.down_proj,
                            weights.to(hidden.dtype), ids, self.act)
        return out + self.shared_experts(hidden)


class KimiLinearDecoderLayer(HybridDecoderLayer):
    """`self_attn` is a LatentAttention or, on linear-attention layers, a KimiDeltaAttentionMixer
    (transformers names both `self_attn`); `mlp` is a GatedMLP or a KimiMoE. Subclasses change the
    latent attention (`attention_class`, a LatentAttention) and the linear mixer (`make_linear_mixer`)."""

    mixer_norm, recurrent = "input_layernorm", "self_attn"
    ff_norm, ff = "post_attention_layernorm", "mlp"
    attention_class = LatentAttention

    def __init__(self, config, i: int):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        if config.layer_types[i] == "full_attention":
            self.self_attn = self.attention_class(h, config.num_attention_heads, config.kv_lora_rank,
                                                  config.q_lora_rank, config.qk_nope_head_dim,
                                                  config.qk_rope_head_dim, config.v_head_dim,
                                                  bias=config.attention_bias)
        else:
            self.self_attn = self.make_linear_mixer(config)
        self.mlp = (KimiMoE(config) if config.mlp_layer_types[i] == "sparse"
                    else GatedMLP(h, config.intermediate_size, act=config.hidden_act))
        self.input_layernorm = RMSNorm(h, eps=eps)
        self.post_attention_layernorm = RMSNorm(h, eps=eps)

    def make_linear_mixer(self, config) -> nn.Module:
        return KimiDeltaAttentionMixer(config.hidden_size, config.linear_num_heads, config.linear_head_dim,
                                       config.linear_conv_kernel_dim, config.rms_norm_eps, config.hidden_act)

    @property
    def is_attention(self) -> bool:
        return isinstance(self.self_attn, LatentAttention)


class KimiLinearBody(nn.Module):
    def __init__(self, config, layer_class=KimiLinearDecoderLayer):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


def published_kda_parts(name: str) -> list[str]:
    """The published names of KDA tensor `name` (transformers' in-memory one):
    `self_attn.{f_a_proj,f_b_proj,dt_bias,A_log}` outside `forget_gate`, and the conv split in
    `q_conv1d` / `k_conv1d` / `v_conv1d` (stacked on read, as transformers' conversion does)."""
    if ".self_attn.forget_gate." in name:
        return [name.replace(".forget_gate.", ".")]
    if name.endswith(".self_attn.conv1d.weight"):
        return [name.replace(".conv1d.", f".{p}_conv1d.") for p in "qkv"]
    return [name]


class PublishedKdaNames(PartsView):
    """A checkpoint seen with transformers' in-memory KDA names when it holds the published ones
    (`published_kda_parts`)."""

    def _parts(self, name: str) -> list[str]:
        return [name] if name in self.ckpt else published_kda_parts(name)


class KimiLinearModel(HybridModel):
    """Parameter names equal transformers' in-memory ones; published checkpoints (`block_sparse_moe`,
    per-expert w1/w2/w3, split q/k/v convs, forget-gate weights on `self_attn`) load too."""

    architecture = ARCHITECTURE

    def __init__(self, config):
        _check_types(config)
        super().__init__(config)
        self.model = KimiLinearBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def load_weights(self, ckpt) -> None:
        super().load_weights(PerExpertView(PublishedKdaNames(MixtralExpertNames(ckpt))))

    def cache_specs(self) -> dict[int, LayerSpec]:
        return layer_cache_specs(self.model.layers, self.dtype)

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        h = run_layers(self.model.layers, self.model.embed_tokens(batch.input_ids), None, batch, caches)
        return self.compute_logits(self.model.norm(h), batch, self.lm_head)


MODEL_CLASS = KimiLinearModel
