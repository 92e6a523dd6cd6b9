"""Qwen4-Exp (transformers' Qwen4ExpForCausalLM, and the text model of Qwen4ExpForConditionalGeneration).

Per `config.layer_types[i]`: "linear_attention" is Qwen3.5's gated delta net (a state slot under
key i); "indexed_attention" is gated attention restricted to the QSA indexer's selection
(models/qwen4_exp_attention.py: KV pages under key i, the indexer's raw-key pages under key
`num_hidden_layers + i`). Layers listed (one-indexed) in `ple_layer_ids` first add per-layer
n-gram embeddings (models/qwen4_exp_ple.py: a conv window and the last token ids in a state slot
under key `num_hidden_layers + i`). The residual is `hc_count` streams; each block reads a gated,
low-rank mix of them and is injected back with per-stream weights; a last mix feeds the LM head
(no final norm). MoE in every layer: softmax top-k with a sigmoid-gated shared expert. Positions are
text positions (the multimodal rope's three axes equal). Tensor parallelism is refused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.specs import LayerSpec

from .base import HybridModel
from .forward_batch import ForwardBatch, ModelCaches
from .moe import PerExpertView, SparseMoE, published_router_name
from .qwen3_5 import SplitProjectionGDN
from .qwen4_exp_attention import QsaAttention
from .qwen4_exp_names import Qwen4ExpNames
from .qwen4_exp_ple import GroupedNorm, PleLayer
from .slot_split import split_decode_prefill

ARCHITECTURE = "Qwen4ExpForCausalLM"


def tiny_config(**overrides):
    """A 4-layer Qwen4ExpTextConfig: GDN, QSA, GDN, QSA; PLE on layers 1 and 3 (n-grams up to 3, 2
    hashed heads each, a small hash vocabulary); QSA blocks of 4, 2 blocks per query, 8 index heads;
    2 hyper-connection streams; 4 experts, top 2, a shared expert; partial rotary 0.5."""
    from transformers import Qwen4ExpTextConfig

    kw = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
              shared_expert_intermediate_size=32, num_experts_per_tok=2, num_experts=4,
              layer_types=["linear_attention", "indexed_attention"] * 2, hc_count=2, hc_lowrank=16,
              ple_layer_ids=[1, 3], ple_embed_dim=32, ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=2,
              ngram_vocab_size_base=1000, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=2,
              indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                               "mrope_section": [2, 1, 1]},
              max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1, pad_token_id=0,
              bos_token_id=1, eos_token_id=2, architectures=[ARCHITECTURE])
    kw.update(overrides)
    return Qwen4ExpTextConfig(**kw)


def check_config(c) -> None:
    """Refuse what the engine would run otherwise than transformers, naming the field."""
    if c.indexer_n_heads is None and "indexed_attention" in c.layer_types:
        raise ValueError("indexed_attention layers without the QSA indexer fields (indexer_n_heads, ...) are "
                         "not supported; transformers' Qwen4-Exp builds an indexer on every such layer")
    if (c.output_gate_type or c.hidden_act) != "silu":
        raise ValueError(f"output_gate_type={c.output_gate_type!r}: only the silu-gated GDN output norm is supported")
    if (c.rope_parameters or {}).get("rope_type", "default") != "default":
        raise ValueError(f"rope_type={c.rope_parameters['rope_type']!r}; only the default rope is supported")
    if c.vocab_size >= 1 << 24:
        raise ValueError(f"vocab_size={c.vocab_size}: PLE keeps token ids as float32, exact below 2^24")


class GatedResidual(nn.Module):
    """`*_hyper_connection` / `hyper_connection_mixer`: streams [T, N x H] -> the block input [T, H]
    (and, with `inject`, the per-stream injection weights [T, N])."""

    def __init__(self, c, inject: bool = True):
        super().__init__()
        self.hc, self.hidden = c.hc_count, c.hidden_size
        width = c.hc_count * c.hidden_size
        self.hc_norm = GroupedNorm(width, c.hidden_size, c.rms_norm_eps)
        self.input_mix_weight_down = nn.Linear(width, c.hc_lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(c.hc_lowrank, width, bias=False)
        self.block_inject_weight = nn.Linear(width, c.hc_count, bias=False) if inject else None

    def forward(self, streams: torch.Tensor):
        normed = self.hc_norm(streams)
        mix = torch.sigmoid(self.input_mix_weight_up(F.silu(self.input_mix_weight_down(normed) / self.hc)))
        mixed = (mix.unflatten(-1, (self.hc, self.hidden)) * normed.unflatten(-1, (self.hc, self.hidden))).mean(dim=-2)
        if self.block_inject_weight is None:
            return mixed
        return mixed, 2 * torch.sigmoid(self.block_inject_weight(normed) / self.hc)


def inject(streams: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """streams [T, N x H] + the block output [T, H] times each stream's weight [T, N]."""
    return streams + (out.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)


class Qwen4ExpDecoderLayer(nn.Module):
    def __init__(self, c, i: int):
        super().__init__()
        self.is_attention = c.layer_types[i] == "indexed_attention"
        if self.is_attention:
            self.self_attn = QsaAttention(c)
        else:
            self.linear_attn = SplitProjectionGDN.from_config(c)
        self.mlp = SparseMoE(c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
                             c.norm_topk_prob, c.shared_expert_intermediate_size, act=c.hidden_act)
        self.ple = PleLayer(c, c.ple_layer_ids.index(i + 1)) if i + 1 in c.ple_layer_ids else None
        self.attn_hyper_connection = GatedResidual(c)
        self.mlp_hyper_connection = GatedResidual(c)

    def cache_specs(self, i: int, n: int, dtype: torch.dtype) -> dict[int, LayerSpec]:
        if self.is_attention:
            return {i: self.self_attn.spec(dtype), n + i: self.self_attn.indexer.spec(dtype)}
        specs: dict[int, LayerSpec] = {i: self.linear_attn.cache_spec(dtype)}
        if self.ple is not None:
            specs[n + i] = self.ple.cache_spec(dtype)
        return specs

    def forward(self, streams, batch: ForwardBatch, caches: ModelCaches, i: int, n: int, split):
        if self.ple is not None:
            streams = streams + self.ple(streams, batch.input_ids, batch, caches.conv[n + i], caches.state[n + i])
        x, weights = self.attn_hyper_connection(streams)
        if self.is_attention:
            x = self.self_attn(x, batch, caches.kv[i], caches.kv[n + i])
        else:
            x = self.linear_attn(x, batch, caches.conv[i], caches.state[i], split)
        streams = inject(streams, x, weights)
        x, weights = self.mlp_hyper_connection(streams)
        return inject(streams, self.mlp(x), weights)


class Qwen4ExpBody(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Qwen4ExpDecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.hyper_connection_mixer = GatedResidual(c, inject=False)


class Qwen4ExpModel(HybridModel):
    """Parameter names: transformers' in-memory ones (the router as `mlp.router`, stored `mlp.gate`)."""

    architecture = ARCHITECTURE

    def __init__(self, config):
        c = getattr(config, "text_config", None) or config
        check_config(c)
        super().__init__(c)
        self.hc = c.hc_count
        self.model = Qwen4ExpBody(c)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def checkpoint_name(self, name: str) -> str | None:
        return published_router_name(name)

    def load_weights(self, ckpt) -> None:
        super().load_weights(PerExpertView(Qwen4ExpNames(ckpt)))

    def cache_specs(self) -> dict[int, LayerSpec]:
        n, specs = len(self.model.layers), {}
        for i, layer in enumerate(self.model.layers):
            specs.update(layer.cache_specs(i, n, self.dtype))
        return specs

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        body, n = self.model, len(self.model.layers)
        streams = body.embed_tokens(batch.input_ids).repeat(1, self.hc)
        split = split_decode_prefill(batch)
        for i, layer in enumerate(body.layers):
            streams = layer(streams, batch, caches, i, n, split)
        return self.compute_logits(body.hyper_connection_mixer(streams), batch, self.lm_head)


MODEL_CLASS = Qwen4ExpModel
