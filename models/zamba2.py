"""Zamba2: a Mamba2 backbone with shared transformer blocks reused at the hybrid layers.

Every layer holds a Mamba2 mixer. A hybrid layer (`layers_block_type[i] == "hybrid"`) first runs
a shared attention + MLP block over [hidden | original embeddings] (width 2H), projects it with
its own `linear` and adds it to the Mamba input (not to the residual). Hybrid layer number s
(its use site) runs block s % num_mem_blocks, with site s's adapters and its own KV cache.

Cache keys (`cache_specs`): key `i` is layer i's Mamba2 state (every layer has one); key
`num_hidden_layers + i` is the KV cache of the attention use site at hybrid layer i. Shared weights,
separate caches: each use site attends over its own keys and values, as transformers' cache does.

Checkpoint names are transformers': a block is stored once, under its first hybrid layer
(`model.layers.{first}.shared_transformer.*`, holding the adapters of all its sites); the other
sites' copies of the same module are filled from there (`tied_weights`).
"""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.specs import LayerSpec

from .base import HybridModel
from .forward_batch import ForwardBatch, ModelCaches
from .mamba2_mixer import Mamba2Mixer
from .norms import RMSNorm
from .rotary import RotaryEmbedding
from .slot_split import SlotSplit, split_decode_prefill
from .zamba2_shared import Zamba2SharedBlock

ARCHITECTURE = "Zamba2ForCausalLM"


def tiny_config(**overrides):
    """A 6-layer Zamba2Config: hybrid layers 1, 3, 4 (sites 0 and 2 share block 0, site 1 runs
    block 1), adapters on, rope on, chunk size 8 to exercise chunking."""
    from transformers import Zamba2Config

    kw = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
              layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid", "mamba"],
              num_attention_heads=4, num_key_value_heads=4, n_mamba_heads=4, mamba_ngroups=2,
              mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, chunk_size=8, num_mem_blocks=2,
              use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True,
              max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.1,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
              architectures=[ARCHITECTURE])
    kw.update(overrides)
    return Zamba2Config(**kw)


class Zamba2MambaDecoderLayer(nn.Module):
    """h -> h + mamba(input_layernorm(h + extra)); `extra` is a hybrid layer's projected block output."""

    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        self.mamba = Mamba2Mixer(h, config.n_mamba_heads, config.mamba_headdim, config.mamba_ngroups,
                                 config.mamba_d_state, config.mamba_d_conv, config.chunk_size,
                                 eps=1e-5,  # transformers fixes the gated norm's eps at 1e-5
                                 conv_bias=True,  # transformers' Zamba2 ignores use_conv_bias
                                 proj_bias=config.add_bias_linear,
                                 dt_limit=(config.time_step_min, float("inf")))
        self.input_layernorm = RMSNorm(h, eps=config.rms_norm_eps)

    def forward(self, h: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, i: int,
                split: SlotSplit, extra: torch.Tensor | None = None) -> torch.Tensor:
        """h [T, H] -> [T, H] through layer i's conv and state pools."""
        x = self.input_layernorm(h if extra is None else h + extra)
        return h + self.mamba(x, batch, caches.conv[i], caches.state[i], split)


class Zamba2HybridLayer(nn.Module):
    """shared_transformer (this site's adapters and KV) -> linear -> added to the Mamba input."""

    def __init__(self, config, shared: Zamba2SharedBlock, site: int, kv_key: int):
        super().__init__()
        self.site, self.kv_key = site, kv_key
        self.shared_transformer = shared  # the same module object at every site of its block
        self.linear = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.mamba_decoder = Zamba2MambaDecoderLayer(config)

    def forward(self, h: torch.Tensor, embeds: torch.Tensor, rope, batch: ForwardBatch,
                caches: ModelCaches, i: int, split: SlotSplit) -> torch.Tensor:
        t = self.shared_transformer(h, embeds, self.site, rope, batch, caches.kv[self.kv_key])
        return self.mamba_decoder(h, batch, caches, i, split, extra=self.linear(t))


class _Zamba2Body(nn.Module):
    def __init__(self, config):
        super().__init__()
        n, types = config.num_hidden_layers, list(config.layers_block_type)
        if len(types) != n:
            raise ValueError(f"layers_block_type has {len(types)} entries but num_hidden_layers is {n}; "
                             f"give one type per layer")
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        sites = [i for i, t in enumerate(types) if t == "hybrid"]
        blocks: list[Zamba2SharedBlock] = []
        layers = []
        for i, kind in enumerate(types):
            if kind != "hybrid":
                layers.append(Zamba2MambaDecoderLayer(config))
                continue
            site = sites.index(i)
            block_id = site % config.num_mem_blocks
            if block_id == len(blocks):  # the block's first site builds it; later sites reuse it
                blocks.append(Zamba2SharedBlock(config, len(sites), block_id))
            layers.append(Zamba2HybridLayer(config, blocks[block_id], site, kv_key=n + i))
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Zamba2Model(HybridModel):
    """Parameter names equal transformers' (model.layers.N.mamba_decoder.mamba.in_proj.weight, ...)."""

    architecture = ARCHITECTURE

    def __init__(self, config):
        super().__init__(config)
        self.model = _Zamba2Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config, config.attention_head_dim) if config.use_mem_rope else None

    def _hybrid_layers(self) -> list[tuple[int, Zamba2HybridLayer]]:
        return [(i, m) for i, m in enumerate(self.model.layers) if isinstance(m, Zamba2HybridLayer)]

    def cache_specs(self) -> dict[int, LayerSpec]:
        # key i: layer i's Mamba2 state; key num_hidden_layers + i: hybrid layer i's attention KV
        specs: dict[int, LayerSpec] = {}
        for i, layer in enumerate(self.model.layers):
            mamba = layer.mamba_decoder.mamba if isinstance(layer, Zamba2HybridLayer) else layer.mamba
            specs[i] = mamba.cache_spec(self.dtype)
        for i, layer in self._hybrid_layers():
            specs[layer.kv_key] = layer.shared_transformer.self_attn.spec(self.dtype)
        return specs

    def tied_weights(self) -> dict[str, str]:
        """Tied embeddings, plus each shared block's later sites -> its first site's tensors."""
        tied = super().tied_weights()
        first: dict[int, int] = {}
        for i, layer in self._hybrid_layers():
            block = layer.shared_transformer
            j = first.setdefault(block.block_id, i)
            if j != i:
                for name in block.state_dict():
                    tied[f"model.layers.{i}.shared_transformer.{name}"] = \
                        f"model.layers.{j}.shared_transformer.{name}"
        return tied

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        embeds = self.model.embed_tokens(batch.input_ids)
        rope = self.rotary(batch.positions) if self.rotary is not None else None
        split = split_decode_prefill(batch)  # one decode/prefill split shared by all Mamba mixers
        h = embeds
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer, Zamba2HybridLayer):
                h = layer(h, embeds, rope, batch, caches, i, split)
            else:
                h = layer(h, batch, caches, i, split)
        return self.compute_logits(self.model.final_layernorm(h), batch, self.lm_head)


MODEL_CLASS = Zamba2Model
