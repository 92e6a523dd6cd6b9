"""Zamba (v1): a multi-head Mamba1 backbone with ONE shared attention + MLP block reused at every
hybrid layer.

Every layer holds a Mamba mixer (models/zamba_mamba_mixer.py). A hybrid layer
(`layers_block_type[i] == "hybrid"`) first runs the shared block over [hidden | original
embeddings] (width 2H, no rope, scale (head_dim / 2) ** -0.5), projects its output with its own
`linear` and adds it to the Mamba input (not to the residual). Unlike Zamba2 there are no per-site
adapters and a single shared block.

Cache keys (`cache_specs`): key `i` is layer i's Mamba state; key `num_hidden_layers + i` is the
KV cache of the shared block's use at hybrid layer i (shared weights, one KV cache per use, as
transformers' cache keeps them).
Checkpoint names are transformers': the block is stored once, under the first hybrid layer
(`model.layers.{first}.shared_transf.*`); later hybrid layers load from there (`tied_weights`).
"""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.specs import LayerSpec

from .attention import PagedAttention
from .base import HybridModel
from .forward_batch import ForwardBatch, ModelCaches
from .mlp import GatedMLP
from .norms import RMSNorm
from .slot_split import SlotSplit, split_decode_prefill
from .zamba_mamba_mixer import ZambaMambaMixer

ARCHITECTURE = "ZambaForCausalLM"
_LAYER_TYPES = ("linear_attention", "hybrid")


def tiny_config(**overrides):
    """A 5-layer ZambaConfig: hybrid layers 1 and 3 share the block; 2 Mamba heads, gelu MLP;
    dt initialised in [0.1, 1] rather than [0.001, 0.1], so the scans carry state that matters
    (tests/family_checks.py's tiny_zamba also scales x_proj)."""
    from transformers import ZambaConfig

    kw = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
              layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid",
                                 "linear_attention"],
              num_attention_heads=4, num_key_value_heads=4, n_mamba_heads=2, mamba_d_state=8,
              mamba_d_conv=4, mamba_expand=2, time_step_min=0.1, time_step_max=1.0,
              max_position_embeddings=512, rms_norm_eps=1e-5,
              initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=True, architectures=[ARCHITECTURE])
    kw.update(overrides)
    return ZambaConfig(**kw)


def layer_types(config) -> list[str]:
    """`layers_block_type`, checked: one per layer, each 'linear_attention' (Mamba) or 'hybrid'."""
    types = list(config.layers_block_type)
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"layers_block_type has {len(types)} entries but num_hidden_layers is "
                         f"{config.num_hidden_layers}; give one type per layer")
    for i, t in enumerate(types):
        if t not in _LAYER_TYPES:
            raise ValueError(f"layers_block_type[{i}] is {t!r}; Zamba layers are "
                             f"{' or '.join(repr(k) for k in _LAYER_TYPES)}")
    return types


def _check_options(config) -> None:
    if config.hidden_mamba_act != "silu":
        raise ValueError(f"hidden_mamba_act={config.hidden_mamba_act!r}; the Mamba kernels here "
                         f"apply 'silu' only")


class ZambaMambaDecoderLayer(nn.Module):
    """h -> h + mamba(input_layernorm(h + extra)); `extra` is a hybrid layer's projected block output."""

    def __init__(self, config):
        super().__init__()
        self.mamba = ZambaMambaMixer(config.hidden_size, config.mamba_expand, config.n_mamba_heads,
                                     config.mamba_d_state, config.mamba_d_conv, config.mamba_dt_rank,
                                     conv_bias=config.mamba_conv_bias, proj_bias=config.mamba_proj_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, h: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, i: int,
                split: SlotSplit, extra: torch.Tensor | None = None) -> torch.Tensor:
        x = self.input_layernorm(h if extra is None else h + extra)
        return h + self.mamba(x, batch, caches.conv[i], caches.state[i], split)


class ZambaSharedBlock(nn.Module):
    """[hidden | embeddings] (2H) -> input_layernorm -> self_attn (-> H) -> pre_ff_layernorm ->
    feed_forward; no residual inside, as transformers' ZambaAttentionDecoderLayer."""

    def __init__(self, config):
        super().__init__()
        width, heads, head_dim = config.attention_hidden_size, config.num_attention_heads, config.attention_head_dim
        self.self_attn = PagedAttention(width, heads, config.num_key_value_heads, head_dim,
                                        scale=(head_dim / 2) ** -0.5, out_size=config.hidden_size)  # to H, not 2H
        self.feed_forward = GatedMLP(config.hidden_size, config.intermediate_size, act=config.hidden_act)
        self.input_layernorm = RMSNorm(width, eps=config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden, embeds, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """hidden, embeds [T, H] -> [T, H], this use's K/V in `kv_cache`."""
        x = self.input_layernorm(torch.cat([hidden, embeds], dim=-1))
        x = self.self_attn(x, None, batch, kv_cache)
        return self.feed_forward(self.pre_ff_layernorm(x))


class ZambaHybridLayer(nn.Module):
    """shared_transf (this use's KV) -> linear -> added to the Mamba input."""

    def __init__(self, config, shared: ZambaSharedBlock, kv_key: int):
        super().__init__()
        self.kv_key = kv_key
        self.shared_transf = shared  # the same module object at every hybrid layer
        self.linear = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.mamba_decoder = ZambaMambaDecoderLayer(config)

    def forward(self, h, embeds, batch: ForwardBatch, caches: ModelCaches, i: int,
                split: SlotSplit) -> torch.Tensor:
        t = self.shared_transf(h, embeds, batch, caches.kv[self.kv_key])
        return self.mamba_decoder(h, batch, caches, i, split, extra=self.linear(t))


class _Body(nn.Module):
    def __init__(self, config):
        super().__init__()
        n, types = config.num_hidden_layers, layer_types(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        shared = ZambaSharedBlock(config) if "hybrid" in types else None
        self.layers = nn.ModuleList(
            ZambaHybridLayer(config, shared, kv_key=n + i) if t == "hybrid" else ZambaMambaDecoderLayer(config)
            for i, t in enumerate(types))
        self.final_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class ZambaModel(HybridModel):
    """Parameter names equal transformers' (model.layers.N.mamba_decoder.mamba.in_proj.weight, ...)."""

    architecture = ARCHITECTURE

    def __init__(self, config):
        super().__init__(config)
        _check_options(config)
        self.model = _Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def _hybrid_layers(self) -> list[tuple[int, ZambaHybridLayer]]:
        return [(i, m) for i, m in enumerate(self.model.layers) if isinstance(m, ZambaHybridLayer)]

    def cache_specs(self) -> dict[int, LayerSpec]:
        specs: dict[int, LayerSpec] = {}
        for i, layer in enumerate(self.model.layers):
            mamba = layer.mamba_decoder.mamba if isinstance(layer, ZambaHybridLayer) else layer.mamba
            specs[i] = mamba.cache_spec(self.dtype)
        for _, layer in self._hybrid_layers():
            specs[layer.kv_key] = layer.shared_transf.self_attn.spec(self.dtype)
        return specs

    def tied_weights(self) -> dict[str, str]:
        """Tied embeddings, plus every later hybrid layer's shared block -> the first one's."""
        tied = super().tied_weights()
        hybrid = self._hybrid_layers()
        if hybrid:
            first = hybrid[0][0]
            for i, layer in hybrid[1:]:
                for name in layer.shared_transf.state_dict():
                    tied[f"model.layers.{i}.shared_transf.{name}"] = f"model.layers.{first}.shared_transf.{name}"
        return tied

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        embeds = self.model.embed_tokens(batch.input_ids)
        split = split_decode_prefill(batch)  # one decode/prefill split shared by all Mamba mixers
        h = embeds
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer, ZambaHybridLayer):
                h = layer(h, embeds, batch, caches, i, split)
            else:
                h = layer(h, batch, caches, i, split)
        return self.compute_logits(self.model.final_layernorm(h), batch, self.lm_head)


MODEL_CLASS = ZambaModel
