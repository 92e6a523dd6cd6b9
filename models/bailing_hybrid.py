"""Ling 3 (BailingHybrid): bounded-gate Kimi delta attention layers (state slots) and gated,
rotary multi-head latent attention layers (latent KV pages) per `config.layer_types`; a dense
SwiGLU or a DeepSeek-V3-style MoE per `config.mlp_layer_types`. Pre-norm residual blocks, as
Kimi-Linear's, with the differences in models/bailing_delta_attention.py and
models/gated_latent_attention.py. The MTP layers a published checkpoint stores after the decoder
are not run (transformers ignores them too).
"""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.specs import LayerSpec

from .bailing_delta_attention import BailingDeltaAttentionMixer
from .base import HybridModel
from .decoder import layer_cache_specs, run_layers
from .forward_batch import ForwardBatch, ModelCaches
from .gated_latent_attention import GatedLatentAttention
from .kimi_linear import KimiLinearDecoderLayer, KimiLinearBody, PublishedKdaNames
from .moe import PerExpertView
from .rotary import RotaryEmbedding

ARCHITECTURE = "BailingHybridForCausalLM"
_LAYER_TYPES = ("linear_attention", "full_attention")
_MLP_TYPES = ("dense", "sparse")


def tiny_config(**overrides):
    """A 4-layer BailingHybridConfig: KDA, MLA, KDA, MLA; layer 0 dense, then MoE (4 experts in 2
    groups, top-2 from 1 group, a shared expert, routed scaling 2); MLA with a low-rank q path and
    8 rotary dims; KDA with 4 heads of 16."""
    from transformers import BailingHybridConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
              layer_types=["linear_attention", "full_attention"] * 2,
              mlp_layer_types=["dense", "sparse", "sparse", "sparse"], short_conv_kernel_size=4,
              kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
              num_local_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
              routed_scaling_factor=2.0, n_shared_experts=1, num_mtp_layers=0,
              max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5,
              initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, architectures=[ARCHITECTURE])
    kw.update(overrides)
    return BailingHybridConfig(**kw)


def check_config(config) -> None:
    """Refuse what this module would run differently from transformers: ValueError naming the option."""
    for name, values, allowed in (("layer_types", config.layer_types, _LAYER_TYPES),
                                  ("mlp_layer_types", config.mlp_layer_types, _MLP_TYPES)):
        for i, t in enumerate(values):
            if t not in allowed:
                raise ValueError(f"{name}[{i}] is {t!r}; BailingHybrid layers are one of {allowed}")
    rope_type = (config.rope_parameters or {}).get("rope_type", "default")
    if rope_type != "default":
        # transformers rescales the MLA scores with yarn's mscale for other rope types
        raise ValueError(f"rope_parameters.rope_type is {rope_type!r}; only 'default' BailingHybrid "
                         f"rotary is supported")
    if config.num_key_value_heads != config.num_attention_heads:
        raise ValueError(f"num_key_value_heads={config.num_key_value_heads} differs from "
                         f"num_attention_heads={config.num_attention_heads}; latent attention expands "
                         f"one key and value per head")


class BailingHybridDecoderLayer(KimiLinearDecoderLayer):
    """Kimi-Linear's layer with a GatedLatentAttention or, on linear-attention layers, a
    BailingDeltaAttentionMixer (transformers names both `self_attn`); `mlp` is a GatedMLP or a KimiMoE."""

    attention_class = GatedLatentAttention

    def make_linear_mixer(self, config) -> nn.Module:
        return BailingDeltaAttentionMixer(
            config.hidden_size, config.linear_num_heads, config.linear_head_dim, config.linear_conv_kernel_dim,
            config.rms_norm_eps, config.hidden_act, config.kda_safe_gate, config.kda_lower_bound)


class _PublishedLingNames:
    """A checkpoint seen with transformers' in-memory names when it holds Ling's published ones
    (`model.word_embeddings`, `.attention.` for `.self_attn.`, `attention.dense` for `o_proj`,
    `mlp.gate.expert_bias` for the correction bias); KDA's forget-gate and split-conv names are
    PublishedKdaNames', per-expert tensors PerExpertView's."""

    def __init__(self, ckpt):
        self.ckpt = ckpt

    def _published(self, name: str) -> str:
        if name in self.ckpt:
            return name
        name = name.replace("model.embed_tokens.", "model.word_embeddings.", 1)
        name = name.replace(".self_attn.o_proj.", ".attention.dense.").replace(".self_attn.", ".attention.")
        return name.replace(".mlp.gate.e_score_correction_bias", ".mlp.gate.expert_bias")

    def __contains__(self, name: str) -> bool:
        return self._published(name) in self.ckpt

    def get(self, name: str) -> torch.Tensor:
        return self.ckpt.get(self._published(name))


class BailingHybridModel(HybridModel):
    """Parameter names equal transformers' in-memory ones; published checkpoints load too."""

    architecture = ARCHITECTURE

    def __init__(self, config):
        check_config(config)
        super().__init__(config)
        self.model = KimiLinearBody(config, BailingHybridDecoderLayer)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config, config.qk_rope_head_dim)

    def load_weights(self, ckpt) -> None:
        super().load_weights(PerExpertView(PublishedKdaNames(_PublishedLingNames(ckpt))))

    def cache_specs(self) -> dict[int, LayerSpec]:
        return layer_cache_specs(self.model.layers, self.dtype)

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        h = run_layers(self.model.layers, self.model.embed_tokens(batch.input_ids), self.rotary, batch, caches)
        return self.compute_logits(self.model.norm(h), batch, self.lm_head)


MODEL_CLASS = BailingHybridModel
