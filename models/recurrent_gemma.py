"""RecurrentGemma (Griffin): RG-LRU recurrent blocks and local (sliding-window) attention.

Layers follow `block_types` repeated (default recurrent, recurrent, attention). Every attention
layer attends over the last `attention_window_size` positions (its AttentionSpec carries the
window, so the memory manager frees KV blocks that left it); a recurrent layer keeps a conv
window and a float32 RG-LRU state in a state slot (models/rg_lru_mixer.py).
transformers' details kept here: embeddings times sqrt(hidden_size) rounded to bfloat16 (its
`normalizer` buffer), Gemma's (1 + w) RMSNorm, rope on the first half of each head
(partial_rotary_factor 0.5), an o_proj bias, a gelu_tanh MLP of width intermediate_size // 2
with biases, and logits soft-capped as cap * tanh(logits / cap).
"""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.specs import LayerSpec

from .attention import PagedAttention
from .base import HybridModel
from .decoder import HybridDecoderLayer, layer_cache_specs, rotary_for, run_layers
from .forward_batch import ForwardBatch, ModelCaches
from .mlp import GatedMLP
from .norms import RMSNorm
from .rg_lru_mixer import RGLRUBlock

ARCHITECTURE = "RecurrentGemmaForCausalLM"
_BLOCK_TYPES = ("recurrent", "attention")
# Nothing bounds the length (local attention, rope, a recurrence; configs carry no
# max_position_embeddings); a cap keeps the engine's length checks meaningful, as for Mamba.
MAX_MODEL_LEN = 1 << 20


def tiny_config(**overrides):
    """A 4-layer RecurrentGemmaConfig (recurrent, recurrent, attention, recurrent): width 80 (so
    sqrt(80) is not a bfloat16 number and the embedding scale's rounding shows), 5 heads of 16
    sharing one KV head (MQA, as published), window 24 (one and a half blocks of 16), logits soft
    cap 2 (below the tiny model's logits, so the cap bites)."""
    from transformers import RecurrentGemmaConfig

    kw = dict(vocab_size=128, hidden_size=80, intermediate_size=192, num_hidden_layers=4,
              num_attention_heads=5, num_key_value_heads=1, lru_width=80, attention_window_size=24,
              conv1d_width=4, logits_soft_cap=2.0, rms_norm_eps=1e-6,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
              architectures=[ARCHITECTURE])
    kw.update(overrides)
    return RecurrentGemmaConfig(**kw)


def block_types(config) -> list[str]:
    """Each layer's block type ("recurrent" / "attention"), `block_types` repeated as transformers
    does; a ValueError names an unknown one."""
    types = list(config.block_types)
    for i, t in enumerate(types):
        if t not in _BLOCK_TYPES:
            raise ValueError(f"block_types[{i}] is {t!r}; RecurrentGemma blocks are "
                             f"{' or '.join(repr(b) for b in _BLOCK_TYPES)}")
    if not types:
        raise ValueError("block_types is empty; give at least one of 'recurrent' / 'attention'")
    return (types * (config.num_hidden_layers // len(types) + 1))[:config.num_hidden_layers]


def _check_options(config) -> None:
    act = config.hidden_activation
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation={act!r}; RecurrentGemma runs 'gelu_pytorch_tanh' only")
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope != "default":
        raise ValueError(f"rope_parameters.rope_type={rope!r}; RecurrentGemma (as transformers) "
                         f"runs the 'default' rope only")
    if config.head_dim * config.num_attention_heads != config.hidden_size:
        raise ValueError(f"hidden_size={config.hidden_size} is not num_attention_heads="
                         f"{config.num_attention_heads} x head_dim={config.head_dim}")


class RecurrentGemmaDecoderLayer(HybridDecoderLayer):
    """Griffin's residual block: temporal_pre_norm -> temporal block (RG-LRU or local attention),
    residual, channel_pre_norm -> mlp_block, residual. The attention block is `self_attn` here and
    `temporal_block` in the checkpoint (RecurrentGemmaModel.checkpoint_name)."""

    mixer_norm, recurrent = "temporal_pre_norm", "temporal_block"
    ff_norm, ff = "channel_pre_norm", "mlp_block"

    def __init__(self, config, kind: str):
        super().__init__()
        h = config.hidden_size
        if kind == "attention":
            self.self_attn = PagedAttention(h, config.num_attention_heads, config.num_key_value_heads,
                                            config.head_dim, qkv_bias=config.attention_bias,
                                            o_bias=True, sliding_window=config.attention_window_size)
        else:
            self.temporal_block = RGLRUBlock(h, config.lru_width, config.num_attention_heads,
                                             config.conv1d_width)
        self.temporal_pre_norm = RMSNorm(h, eps=config.rms_norm_eps, zero_centered=True)
        self.channel_pre_norm = RMSNorm(h, eps=config.rms_norm_eps, zero_centered=True)
        self.mlp_block = GatedMLP(h, config.intermediate_size // 2, bias=True, act="gelu_pytorch_tanh")


class _Body(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(RecurrentGemmaDecoderLayer(config, kind) for kind in block_types(config))
        self.final_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, zero_centered=True)


class RecurrentGemmaModel(HybridModel):
    """Parameter names equal the HF checkpoint's, but for each attention layer's `self_attn`,
    which the checkpoint calls `temporal_block`."""

    architecture = ARCHITECTURE

    def __init__(self, config):
        super().__init__(config)
        _check_options(config)
        self.max_model_len = self.max_model_len or MAX_MODEL_LEN
        self.model = _Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = rotary_for(config, self.model.layers)
        # transformers keeps sqrt(hidden_size) in a bfloat16 buffer: the rounded value is the scale
        self.embed_scale = float(torch.tensor(config.hidden_size ** 0.5, dtype=torch.bfloat16, device="cpu"))
        self.soft_cap = float(config.logits_soft_cap)

    def checkpoint_name(self, name: str) -> str | None:
        return name.replace(".self_attn.", ".temporal_block.")

    def cache_specs(self) -> dict[int, LayerSpec]:
        return layer_cache_specs(self.model.layers, self.dtype)

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        h = self.model.embed_tokens(batch.input_ids) * self.embed_scale
        h = run_layers(self.model.layers, h, self.rotary, batch, caches)
        logits = self.compute_logits(self.model.final_norm(h), batch, self.lm_head)
        return torch.tanh(logits / self.soft_cap) * self.soft_cap


MODEL_CLASS = RecurrentGemmaModel
