"""MiniMax (MiniMax-Text-01 / M1): lightning-attention layers and softmax-attention layers
(`config.layer_types`), a sparse MoE in every layer.

The block differs from the other hybrids: the residual is taken AFTER each norm and the two
branches are weighted, `h = alpha * norm(h) + beta * mixer(norm(h))` with the config's
`{linear,full}_attn_{alpha,beta}_factor`, then the same with `mlp_{alpha,beta}_factor` around the
MoE (softmax routing, top-k renormalised, no shared expert).
"""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.specs import LayerSpec

from .attention import PagedAttention
from .base import HybridModel
from .decoder import HybridDecoderLayer, layer_cache_specs, rotary_for, run_layers
from .forward_batch import ForwardBatch, ModelCaches
from .lightning_mixer import LightningAttentionMixer
from .mixtral_names import MixtralExpertNames
from .moe import PerExpertView, SparseMoE, published_router_name
from .norms import RMSNorm
from .slot_split import SlotSplit

ARCHITECTURE = "MiniMaxForCausalLM"
_LAYER_TYPES = ("linear_attention", "full_attention")


def tiny_config(**overrides):
    """A 4-layer MiniMaxConfig: lightning, attention, lightning, attention; 4 experts, top-2;
    lightning blocks of 16 tokens (transformers' prefill chunk) and residual weights that are
    not 1, so every factor is exercised."""
    from transformers import MiniMaxConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              layer_types=["linear_attention", "full_attention"] * 2, block_size=16,
              num_local_experts=4, num_experts_per_tok=2, full_attn_alpha_factor=1.2,
              full_attn_beta_factor=0.9, linear_attn_alpha_factor=0.8, linear_attn_beta_factor=1.1,
              mlp_alpha_factor=0.9, mlp_beta_factor=1.3, max_position_embeddings=512,
              rms_norm_eps=1e-5, initializer_range=0.1, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False, architectures=[ARCHITECTURE])
    kw.update(overrides)
    return MiniMaxConfig(**kw)


def _check_options(config) -> None:
    """Refuse options transformers' MiniMax ignores, where a checkpoint trained with them would run
    wrongly here too: partial rotary (`rotary_dim` < head_dim, or a partial_rotary_factor; the
    model rotates every head dim) and pre-norm residuals (`postnorm: false`; the residual here is
    always taken after the norm)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rotary_dim = getattr(config, "rotary_dim", None)
    partial = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
    if rotary_dim not in (None, head_dim) or partial != 1.0:
        raise ValueError(f"config sets rotary_dim={rotary_dim} / partial_rotary_factor={partial} with "
                         f"head_dim={head_dim}: partial rotary is not supported (transformers' MiniMax "
                         f"rotates all {head_dim} dims, so a checkpoint trained otherwise would run "
                         f"wrongly); use a config whose rotary covers the whole head")
    if getattr(config, "postnorm", True) is not True:
        raise ValueError(f"config sets postnorm={config.postnorm!r}: only the post-norm residual "
                         f"(postnorm: true, transformers' MiniMax) is supported")


class MiniMaxDecoderLayer(HybridDecoderLayer):
    """`self_attn` is a PagedAttention or, on linear-attention layers, a LightningAttentionMixer
    (the checkpoint names both `self_attn`); `mlp` is the MoE (`block_sparse_moe` as published)."""

    def __init__(self, config, i: int):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        kind = config.layer_types[i]
        if kind not in _LAYER_TYPES:
            raise ValueError(f"layer_types[{i}] is {kind!r}; MiniMax layers are one of {_LAYER_TYPES}")
        head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
        if kind == "full_attention":
            self.self_attn = PagedAttention(h, config.num_attention_heads, config.num_key_value_heads,
                                            head_dim, sliding_window=config.sliding_window)
            self.alpha, self.beta = config.full_attn_alpha_factor, config.full_attn_beta_factor
        else:
            self.self_attn = LightningAttentionMixer(h, config.num_attention_heads, head_dim, i,
                                                     config.num_hidden_layers, config.hidden_act)
            self.alpha, self.beta = config.linear_attn_alpha_factor, config.linear_attn_beta_factor
        self.mlp_alpha, self.mlp_beta = config.mlp_alpha_factor, config.mlp_beta_factor
        self.mlp = SparseMoE(h, config.intermediate_size, config.num_local_experts,
                             config.num_experts_per_tok, norm_topk_prob=True, act=config.hidden_act)
        self.input_layernorm = RMSNorm(h, eps=eps)
        self.post_attention_layernorm = RMSNorm(h, eps=eps)

    @property
    def is_attention(self) -> bool:
        return isinstance(self.self_attn, PagedAttention)

    def cache_spec(self, dtype: torch.dtype) -> LayerSpec:
        return self.self_attn.spec(dtype) if self.is_attention else self.self_attn.cache_spec(dtype)

    def forward(self, h: torch.Tensor, rope, batch: ForwardBatch, caches: ModelCaches, i: int,
                split: SlotSplit) -> torch.Tensor:
        """h [T, H] -> [T, H]; this is model layer `i` (its KV or state pool in `caches`)."""
        x = self.input_layernorm(h)
        if self.is_attention:
            y = self.self_attn(x, rope, batch, caches.kv[i])
        else:
            y = self.self_attn(x, batch, caches.state[i], split)
        x = self.post_attention_layernorm(x * self.alpha + y * self.beta)
        return x * self.mlp_alpha + self.mlp(x) * self.mlp_beta


class _MiniMaxBody(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MiniMaxDecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class MiniMaxModel(HybridModel):
    """Parameter names equal transformers' in-memory ones except the router (ours `mlp.router`,
    theirs `mlp.gate`); published checkpoints (`block_sparse_moe.*`, per-expert w1/w2/w3) and
    transformers' fused expert tensors both load. The `slope_rate` / `*_decay` buffers are not read."""

    architecture = ARCHITECTURE

    def __init__(self, config):
        _check_options(config)
        super().__init__(config)
        self.model = _MiniMaxBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = rotary_for(config, self.model.layers)

    def checkpoint_name(self, name: str) -> str | None:
        return published_router_name(name)

    def load_weights(self, ckpt) -> None:
        super().load_weights(PerExpertView(MixtralExpertNames(ckpt)))

    def cache_specs(self) -> dict[int, LayerSpec]:
        return layer_cache_specs(self.model.layers, self.dtype)

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        h = run_layers(self.model.layers, self.model.embed_tokens(batch.input_ids), self.rotary,
                       batch, caches)
        return self.compute_logits(self.model.norm(h), batch, self.lm_head)


MODEL_CLASS = MiniMaxModel
