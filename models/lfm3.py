"""LFM3: LFM2's gated short-conv layers beside sliding-window AND full attention layers.

`config.layer_types[i]` is "conv", "sliding_attention" (window `sliding_window`) or
"full_attention": three kinds of layer memory in one model (a conv window per slot, and two KV
groups, each with its own pool and tables). Differences from LFM2, as transformers' Lfm3:
- attention is Qwen3's (q_norm / k_norm per head) with a sigmoid gate per head from the layer
  input (`g_proj`), and each layer type has its own rope (`rope_parameters[layer_type]`: by
  default plain rope for sliding layers, proportional rope on half the head for full ones);
- sandwich norms: `post_operator_norm` and `post_ffn_norm` on each branch before the residual;
- the feed-forward is a SwiGLU of width `intermediate_size` (w1 / w3 / w2).
"""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.specs import LayerSpec

from .attention import PagedAttention
from .base import HybridModel
from .checkpoint import renamed
from .decoder import HybridDecoderLayer, layer_cache_specs
from .forward_batch import ForwardBatch, ModelCaches
from .mlp import GatedMLP
from .norms import RMSNorm
from .rotary import RotaryEmbedding
from .short_conv import ShortConv
from .slot_split import SlotSplit, split_decode_prefill

ARCHITECTURE = "Lfm3ForCausalLM"
KINDS = ("conv", "sliding_attention", "full_attention")

_RENAMES = {".feed_forward.gate_proj.": ".feed_forward.w1.", ".feed_forward.up_proj.": ".feed_forward.w3.",
            ".feed_forward.down_proj.": ".feed_forward.w2.",
            ".self_attn.g_proj.": ".self_attn.gate_proj."}  # transformers saves its g_proj so


def tiny_config(**overrides):
    """A 6-layer Lfm3Config: conv, sliding, full, conv, sliding, full; window 24 (one and a half
    blocks of 16); conv kernel 3; the default per-type ropes; tied embeddings."""
    from transformers import Lfm3Config

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=24,
              layer_types=["conv", "sliding_attention", "full_attention"] * 2, conv_L_cache=3,
              max_position_embeddings=512, norm_eps=1e-5, initializer_range=0.1,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
              architectures=[ARCHITECTURE])
    kw.update(overrides)
    return Lfm3Config(**kw)


class LayerTypeRotary(RotaryEmbedding):
    """positions [T] -> (cos, sin) [T, head_dim] for one layer type's rope, as transformers builds
    it (`ROPE_INIT_FUNCTIONS[type](config, layer_type=...)`; proportional rope leaves the
    unrotated angles at cos 1, sin 0)."""

    def __init__(self, config, layer_type: str, head_dim: int):
        nn.Module.__init__(self)  # RotaryEmbedding's forward on this layer type's inv_freq
        params = config.rope_parameters[layer_type]
        if params["rope_type"] == "default":
            inv = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if params["rope_type"] not in ROPE_INIT_FUNCTIONS:
                raise NotImplementedError(f"rope_type {params['rope_type']!r} of {layer_type} layers is unknown")
            with torch.device("cpu"):  # models are built under the meta device
                inv, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, torch.device("cpu"), layer_type=layer_type)
        self._inv_freq, self.scaling = inv.float().cpu(), float(scaling)
        self.rotary_dim = 2 * self._inv_freq.numel()


class Lfm3DecoderLayer(HybridDecoderLayer):
    """`self_attn` or `conv` after `operator_norm`, `post_operator_norm`, residual; `feed_forward`
    after `ffn_norm`, `post_ffn_norm`, residual (HF names)."""

    mixer_norm, recurrent = "operator_norm", "conv"
    ff_norm, ff = "ffn_norm", "feed_forward"

    def __init__(self, config, i: int):
        super().__init__()
        h, eps = config.hidden_size, config.norm_eps
        self.kind = config.layer_types[i]
        if self.kind not in KINDS:
            raise ValueError(f"layer_types[{i}] is {self.kind!r}; LFM3 layers are one of {KINDS}")
        if self.kind != "conv":
            self.self_attn = PagedAttention(
                h, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                qk_norm=lambda d: RMSNorm(d, eps=eps), head_gate=config.use_attention_gate,
                sliding_window=config.sliding_window if self.kind == "sliding_attention" else None)
        else:
            self.conv = ShortConv(h, config.conv_L_cache, bias=config.conv_bias)
        self.feed_forward = GatedMLP(h, config.intermediate_size, bias=False, act="silu")
        self.operator_norm = RMSNorm(h, eps=eps)
        self.ffn_norm = RMSNorm(h, eps=eps)
        sandwich = config.use_sandwich_norm
        self.post_operator_norm = RMSNorm(h, eps=eps) if sandwich else nn.Identity()
        self.post_ffn_norm = RMSNorm(h, eps=eps) if sandwich else nn.Identity()

    def forward(self, h: torch.Tensor, rope, batch: ForwardBatch, caches: ModelCaches, i: int,
                split: SlotSplit) -> torch.Tensor:
        """h [T, H] -> [T, H]; rope: this layer type's (cos, sin)."""
        x = self.operator_norm(h)
        if self.is_attention:
            x = self.self_attn(x, rope, batch, caches.kv[i])
        else:
            x = self.conv(x, batch, caches.conv[i], split)  # a short conv keeps no SSM state
        h = h + self.post_operator_norm(x)
        return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))


class _Lfm3Body(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Lfm3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.embedding_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)  # the final norm, as in LFM2


class Lfm3Model(HybridModel):
    """Parameter names equal the HF checkpoint's except the feed-forward (w1 / w3 / w2) and the
    head gate (saved as `self_attn.gate_proj`)."""

    architecture = ARCHITECTURE

    def __init__(self, config):
        super().__init__(config)
        self.model = _Lfm3Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        kinds = {layer.kind for layer in self.model.layers} - {"conv"}
        self.rotary = {k: LayerTypeRotary(config, k, config.head_dim) for k in sorted(kinds)}

    def checkpoint_name(self, name: str) -> str | None:
        return renamed(name, _RENAMES)

    def cache_specs(self) -> dict[int, LayerSpec]:
        return layer_cache_specs(self.model.layers, self.dtype)

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        ropes = {k: rotary(batch.positions) for k, rotary in self.rotary.items()}  # once per step
        split = split_decode_prefill(batch)
        h = self.model.embed_tokens(batch.input_ids)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, ropes.get(layer.kind), batch, caches, i, split)
        return self.compute_logits(self.model.embedding_norm(h), batch, self.lm_head)


MODEL_CLASS = Lfm3Model
