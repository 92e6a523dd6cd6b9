"""LFM2: gated short-conv layers and full-attention layers (q/k RMSNorm) by `layer_types`, SwiGLU feed-forward."""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.specs import LayerSpec

from .attention import PagedAttention
from .base import HybridModel
from .checkpoint import renamed
from .decoder import HybridDecoderLayer, layer_cache_specs, rotary_for, run_layers
from .forward_batch import ForwardBatch, ModelCaches
from .mlp import GatedMLP
from .norms import RMSNorm
from .short_conv import ShortConv
from .slot_split import SlotSplit

ARCHITECTURE = "Lfm2ForCausalLM"

# Our module names -> the checkpoint's, for the pieces shared with other families.
LFM2_RENAMES = {
    ".self_attn.o_proj.": ".self_attn.out_proj.",
    ".self_attn.q_norm.": ".self_attn.q_layernorm.",
    ".self_attn.k_norm.": ".self_attn.k_layernorm.",
    ".feed_forward.gate_proj.": ".feed_forward.w1.",
    ".feed_forward.up_proj.": ".feed_forward.w3.",
    ".feed_forward.down_proj.": ".feed_forward.w2.",
}


def tiny_config(**overrides):
    """A 4-layer Lfm2Config (conv, conv, attention, conv), conv kernel 3, feed-forward width
    auto-adjusted from 192 to 128 (2/3, rounded up to a multiple of 32), tied embeddings."""
    from transformers import Lfm2Config

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=192, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2,
              layer_types=["conv", "conv", "full_attention", "conv"], conv_L_cache=3,
              conv_bias=False, block_auto_adjust_ff_dim=True, block_multiple_of=32,
              block_ffn_dim_multiplier=1.0, max_position_embeddings=512, norm_eps=1e-5,
              initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=True, architectures=[ARCHITECTURE])
    kw.update(overrides)
    return Lfm2Config(**kw)


def ff_dim(config) -> int:
    """The feed-forward width transformers' Lfm2MLP builds from `intermediate_size` and the block_* knobs."""
    size = config.intermediate_size
    if config.block_auto_adjust_ff_dim:
        size = int(2 * size / 3)
        if config.block_ffn_dim_multiplier is not None:
            size = int(config.block_ffn_dim_multiplier * size)
            m = config.block_multiple_of
            size = m * ((size + m - 1) // m)
    return size


def _is_attention(config, i: int, family: str = "LFM2") -> bool:
    kind = config.layer_types[i]
    if kind not in ("conv", "full_attention"):
        raise ValueError(f"layer_types[{i}] is {kind!r}; {family} layers are 'conv' or 'full_attention'")
    return kind == "full_attention"


class Lfm2DecoderLayer(HybridDecoderLayer):
    """Pre-norm residual block: `self_attn` or `conv` after `operator_norm`, then `feed_forward`
    after `ffn_norm` (HF names). Subclasses change the feed-forward (`make_feed_forward`) and the
    family named in errors (`family`)."""

    mixer_norm, recurrent = "operator_norm", "conv"  # the checkpoint's module names
    ff_norm, ff = "ffn_norm", "feed_forward"
    family = "LFM2"

    def __init__(self, config, i: int):
        super().__init__()
        h, eps = config.hidden_size, config.norm_eps
        if _is_attention(config, i, self.family):
            head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
            self.self_attn = PagedAttention(h, config.num_attention_heads, config.num_key_value_heads,
                                            head_dim, qk_norm=lambda d: RMSNorm(d, eps=eps))
        else:
            self.conv = ShortConv(h, config.conv_L_cache, bias=config.conv_bias)
        self.feed_forward = self.make_feed_forward(config, i)
        self.operator_norm = RMSNorm(h, eps=eps)
        self.ffn_norm = RMSNorm(h, eps=eps)

    def mix_recurrent(self, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, i: int,
                      split: SlotSplit) -> torch.Tensor:
        return self.conv(x, batch, caches.conv[i], split)  # a short conv keeps no SSM state

    def make_feed_forward(self, config, i: int) -> nn.Module:
        return GatedMLP(config.hidden_size, ff_dim(config), bias=False, act="silu")


class _Lfm2Body(nn.Module):
    def __init__(self, config, layer_class=Lfm2DecoderLayer):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer_class(config, i) for i in range(config.num_hidden_layers))
        # despite its name, transformers applies it after the last layer (the final norm)
        self.embedding_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)


class Lfm2Model(HybridModel):
    """Parameter names equal the HF checkpoint's except where `LFM2_RENAMES` maps shared modules
    (attention out_proj / q,k_layernorm, feed-forward w1 / w3 / w2)."""

    architecture = ARCHITECTURE
    checkpoint_renames = LFM2_RENAMES  # ours -> the checkpoint's (renamed())
    layer_class = Lfm2DecoderLayer

    def __init__(self, config):
        super().__init__(config)
        self.model = _Lfm2Body(config, self.layer_class)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = rotary_for(config, self.model.layers)

    def checkpoint_name(self, name: str) -> str | None:
        return renamed(name, self.checkpoint_renames)

    def cache_specs(self) -> dict[int, LayerSpec]:
        return layer_cache_specs(self.model.layers, self.dtype)

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        h = run_layers(self.model.layers, self.model.embed_tokens(batch.input_ids), self.rotary,
                       batch, caches)
        return self.compute_logits(self.model.embedding_norm(h), batch, self.lm_head)


MODEL_CLASS = Lfm2Model
