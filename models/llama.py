"""Llama: the pure-attention baseline (also covers Llama-shaped checkpoints with qkv/o biases)."""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.specs import LayerSpec

from .attention import PagedAttention
from .base import HybridModel
from .decoder import HybridDecoderLayer, run_layers
from .forward_batch import ForwardBatch, ModelCaches
from .mlp import GatedMLP
from .norms import RMSNorm
from .rotary import RotaryEmbedding

ARCHITECTURE = "LlamaForCausalLM"


def tiny_config(**overrides):
    """A 2-layer GQA LlamaConfig small enough for CPU tests; `overrides` replace any field."""
    from transformers import LlamaConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.1,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
              architectures=[ARCHITECTURE])
    kw.update(overrides)
    return LlamaConfig(**kw)


class LlamaDecoderLayer(HybridDecoderLayer):
    """`self_attn` after `input_layernorm`, residual; `mlp` after `post_attention_layernorm`,
    residual (HF names)."""

    mixer_norm, ff_norm, ff = "input_layernorm", "post_attention_layernorm", "mlp"

    def __init__(self, config, sliding_window=None):
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        bias = getattr(config, "attention_bias", False)  # Mistral's config has no such field
        self.self_attn = PagedAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
            qkv_bias=bias, o_bias=bias,
            sliding_window=sliding_window)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size,
                            bias=getattr(config, "mlp_bias", False), act=config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class _LlamaBody(nn.Module):
    def __init__(self, config, sliding_window=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, sliding_window)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class LlamaModel(HybridModel):
    """Parameter names equal the HF checkpoint's (model.layers.N.self_attn.q_proj.weight, ...).
    `sliding_window` (None for Llama, which ignores any such config field) goes to every layer."""

    architecture = ARCHITECTURE

    def __init__(self, config, sliding_window=None):
        super().__init__(config)
        self.model = _LlamaBody(config, sliding_window)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config, self.model.layers[0].self_attn.head_dim)

    def cache_specs(self) -> dict[int, LayerSpec]:
        return {i: layer.self_attn.spec(self.dtype) for i, layer in enumerate(self.model.layers)}

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        body = self.model
        h = run_layers(body.layers, body.embed_tokens(batch.input_ids), self.rotary, batch, caches,
                       final_norm=body.norm)
        return self.compute_logits(h, batch, self.lm_head)


MODEL_CLASS = LlamaModel
