"""Qwen3.5 (text): Qwen3-Next's layers with separate GDN input projections and a dense MLP.

Layers follow `config.layer_types` (gated delta net or gated full attention), zero-centered norms
as in Qwen3-Next. What differs: the GDN projects q|k|v, z, b and a with four plain linears
(`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`) instead of Qwen3-Next's per-key-head
interleaved `in_proj_qkvz` / `in_proj_ba`, and every layer's MLP is a dense SwiGLU. Rope is
transformers' interleaved M-RoPE, which for text (the same position on all three axes) is plain
rope over `partial_rotary_factor` of each head. Qwen3.5-MoE (qwen3_5_moe.py) swaps in a MoE.

Published Qwen3.5 checkpoints are multimodal (`Qwen3_5ForConditionalGeneration`: the text config
under `text_config`, text weights under `model.language_model.`); they load here as the text
model alone, as transformers' AutoModelForCausalLM loads them. The vision tower is ignored.
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
from .moe import PerExpertView
from .norms import RMSNorm
from .mtp_head import WithMtp

ARCHITECTURE = "Qwen3_5ForCausalLM"
_LAYER_TYPES = ("linear_attention", "full_attention")


def tiny_config(**overrides):
    """A 4-layer Qwen3_5TextConfig: GDN (2 key heads serving 4 value heads), attention, GDN,
    attention; dense SwiGLU everywhere."""
    from transformers import Qwen3_5TextConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              layer_types=["linear_attention", "full_attention"] * 2,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=512,
              rms_norm_eps=1e-5, initializer_range=0.1, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False, architectures=[ARCHITECTURE])
    kw.update(overrides)
    return Qwen3_5TextConfig(**kw)


class LanguageModelView:
    """A checkpoint seen with text-model names (`model.X`) when it stores a multimodal layout
    (`model.language_model.X`). Wraps anything with `__contains__` and `get(name)`."""

    def __init__(self, ckpt):
        self.ckpt = ckpt

    def _source(self, name: str) -> str:
        if name not in self.ckpt and name.startswith("model."):
            nested = "model.language_model." + name[len("model."):]
            if nested in self.ckpt:
                return nested
        return name

    def __contains__(self, name: str) -> bool:
        return self._source(name) in self.ckpt

    def get(self, name: str):
        return self.ckpt.get(self._source(name))


class SplitProjectionGDN(GatedDeltaNetMixer):
    """Qwen3-Next's GDN mixer with Qwen3.5's projections: `in_proj_qkv` [q | k | v] (the conv's
    channel order), `in_proj_z` [v_heads x dv], `in_proj_b` and `in_proj_a` [v_heads]."""

    @classmethod
    def from_config(cls, config) -> "SplitProjectionGDN":
        """The mixer a config's `linear_*` fields describe (Qwen3.5 and the families that reuse it)."""
        return cls(config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
                   config.linear_key_head_dim, config.linear_value_head_dim,
                   config.linear_conv_kernel_dim, eps=config.rms_norm_eps, activation=config.hidden_act)

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, conv_kernel: int, eps: float, activation: str = "silu"):
        super().__init__(hidden_size, num_k_heads, num_v_heads, head_k_dim, head_v_dim,
                         conv_kernel, eps, activation)
        del self.in_proj_qkvz, self.in_proj_ba  # Qwen3-Next's interleaved layout
        self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False)

    def _split_projections(self, hidden: torch.Tensor):
        """hidden [T, H] -> mixed_qkv [T, conv_dim], z [T, HV, dv], b [T, HV], a [T, HV]."""
        z = self.in_proj_z(hidden).view(-1, self.num_v_heads, self.head_v_dim)
        return self.in_proj_qkv(hidden), z, self.in_proj_b(hidden), self.in_proj_a(hidden)


class Qwen3_5DecoderLayer(HybridDecoderLayer):
    """Pre-norm residual block: `linear_attn` (GDN) or `self_attn` after `input_layernorm`, then
    `mlp` after `post_attention_layernorm` (HF names). `mlp` comes from `make_mlp(config, i)`."""

    mixer_norm, recurrent = "input_layernorm", "linear_attn"  # the checkpoint's module names
    ff_norm, ff = "post_attention_layernorm", "mlp"

    def __init__(self, config, i: int, make_mlp):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        kind = config.layer_types[i]
        if kind not in _LAYER_TYPES:
            raise ValueError(f"layer_types[{i}] is {kind!r}; Qwen3.5 layers are one of {_LAYER_TYPES}")
        if kind == "full_attention":
            head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
            self.self_attn = PagedAttention(
                h, config.num_attention_heads, config.num_key_value_heads, head_dim,
                qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                qk_norm=lambda dim: RMSNorm(dim, eps=eps, zero_centered=True), output_gate=True)
        else:
            self.linear_attn = SplitProjectionGDN.from_config(config)
        self.mlp = make_mlp(config, i)
        self.input_layernorm = RMSNorm(h, eps=eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(h, eps=eps, zero_centered=True)


def dense_mlp(config, i: int) -> nn.Module:
    return GatedMLP(config.hidden_size, config.intermediate_size, act=config.hidden_act)


class _Qwen3_5Body(nn.Module):
    def __init__(self, config, make_mlp):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(config, i, make_mlp)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, zero_centered=True)


class Qwen3_5Model(WithMtp, HybridModel):
    """Parameter names equal the HF checkpoint's (model.layers.N.linear_attn.in_proj_qkv.weight,
    ...). The MTP weights (`mtp.*`) load only when the engine drafts with them (`with_mtp`:
    models/mtp_head.py). Subclasses pass another `make_mlp` (Qwen3.5-MoE)."""

    architecture = ARCHITECTURE

    def __init__(self, config, make_mlp=dense_mlp, with_mtp: bool = False):
        config = getattr(config, "text_config", None) or config  # a multimodal checkpoint's text model
        super().__init__(config)
        self.model = _Qwen3_5Body(config, make_mlp)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # partial_rotary_factor (0.25 by default) comes from config.rope_parameters
        self.rotary = rotary_for(config, self.model.layers)
        self.init_mtp(config, lambda c, i: Qwen3_5DecoderLayer(c, i, make_mlp), with_mtp)

    def load_weights(self, ckpt) -> None:
        """Text-model names as saved by Qwen3_5ForCausalLM or the multimodal layout; MoE experts
        per expert as published or transformers' fused tensors."""
        super().load_weights(PerExpertView(LanguageModelView(ckpt)))

    def cache_specs(self) -> dict[int, LayerSpec]:
        return self.mtp_specs(layer_cache_specs(self.model.layers, self.dtype))

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        h = run_layers(self.model.layers, self.model.embed_tokens(batch.input_ids), self.rotary,
                       batch, caches)
        return self.compute_logits(self.keep_hidden(self.model.norm(h)), batch, self.lm_head)


MODEL_CLASS = Qwen3_5Model
