"""OLMo-Hybrid: gated delta net layers (pre-norm) and OLMo-style attention layers (post-norm).

Layers follow `layer_types` ("linear_attention" / "full_attention"). The GDN is Qwen3-Next's with
plain q / k / v / a / b / g projections, a gated output norm of fixed eps 1e-5 and, with
`linear_allow_neg_eigval`, beta = 2 sigmoid(b) (eigenvalues in (-1, 1)). An attention layer
normalises q and k over all heads at once (before the head split), applies rope only when the
config has a rope_theta (published checkpoints have none: NoPE), and norms the attention and MLP
OUTPUTS before each residual add (no input norm). Names are transformers' in-memory ones except
the GDN's norm and output projection (`o_norm`, `o_proj`); published checkpoints name some
tensors differently and load through PublishedNamesView.
"""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.kernels import ops
from hybridkv.specs import LayerSpec

from .attention import PagedAttention
from .base import HybridModel
from .checkpoint import renamed
from .forward_batch import ForwardBatch, ModelCaches
from .gdn_mixer import GatedDeltaNetMixer
from .mlp import GatedMLP
from .norms import RMSNorm
from .rotary import RotaryEmbedding, apply_rotary
from .slot_split import split_decode_prefill

ARCHITECTURE = "OlmoHybridForCausalLM"
_LAYER_TYPES = ("linear_attention", "full_attention")
_RENAMES = {".linear_attn.norm.": ".linear_attn.o_norm.", ".linear_attn.out_proj.": ".linear_attn.o_proj."}
# transformers' in-memory names -> the published checkpoint's (its conversion mapping, reversed)
_PUBLISHED = {".input_layernorm.": ".attention_layer_norm.",
              ".post_attention_layernorm.": ".feedforward_layer_norm."}


def tiny_config(**overrides):
    """A 4-layer OlmoHybridConfig: GDN (2 key heads serving 4 value heads), attention, GDN,
    attention; rope on (published checkpoints set rope_theta null: NoPE)."""
    from transformers import OlmoHybridConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2,
              layer_types=["linear_attention", "full_attention"] * 2, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_conv_kernel_dim=4, max_position_embeddings=512, rms_norm_eps=1e-6,
              initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, architectures=[ARCHITECTURE])
    kw.update(overrides)
    return OlmoHybridConfig(**kw)


def _layer_kind(config, i: int) -> str:
    kind = config.layer_types[i]
    if kind not in _LAYER_TYPES:
        raise ValueError(f"layer_types[{i}] is {kind!r}; OLMo-Hybrid layers are "
                         f"{' or '.join(repr(k) for k in _LAYER_TYPES)}")
    return kind


def _has_rope(config) -> bool:
    params = getattr(config, "rope_parameters", None)
    return params is not None and params.get("rope_theta") is not None


class PublishedNamesView:
    """A checkpoint seen with transformers' in-memory names when it stores the published ones:
    `attention_layer_norm` / `feedforward_layer_norm` for input / post-attention norms, and the
    GDN conv as three tensors `q_conv1d`, `k_conv1d`, `v_conv1d` (concatenated here, q | k | v)."""

    def __init__(self, ckpt):
        self.ckpt = ckpt

    def _published(self, name: str):
        if name in self.ckpt:
            return None
        if name.endswith(".linear_attn.conv1d.weight"):
            parts = [name.replace(".conv1d.", f".{c}_conv1d.") for c in "qkv"]
            return parts if all(p in self.ckpt for p in parts) else None
        for ours, theirs in _PUBLISHED.items():
            if ours in name and name.replace(ours, theirs) in self.ckpt:
                return [name.replace(ours, theirs)]
        return None

    def __contains__(self, name: str) -> bool:
        return name in self.ckpt or self._published(name) is not None

    def get(self, name: str) -> torch.Tensor:
        parts = self._published(name)
        if parts is None:
            return self.ckpt.get(name)  # the checkpoint's own "missing tensor" error
        return torch.cat([self.ckpt.get(p) for p in parts]) if len(parts) > 1 else self.ckpt.get(parts[0])


class OlmoGDN(GatedDeltaNetMixer):
    """The GDN with OLMo-Hybrid's projections: q_proj, k_proj, v_proj (the conv's channel order),
    g_proj (the output gate), a_proj and b_proj [v_heads]."""

    def __init__(self, config):
        super().__init__(config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
                         config.linear_key_head_dim, config.linear_value_head_dim,
                         config.linear_conv_kernel_dim, eps=1e-5, activation=config.hidden_act)
        del self.in_proj_qkvz, self.in_proj_ba  # Qwen3-Next's interleaved layout
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.key_dim, bias=False)
        self.k_proj = nn.Linear(h, self.key_dim, bias=False)
        self.v_proj = nn.Linear(h, self.value_dim, bias=False)
        self.g_proj = nn.Linear(h, self.value_dim, bias=False)
        self.a_proj = nn.Linear(h, self.num_v_heads, bias=False)
        self.b_proj = nn.Linear(h, self.num_v_heads, bias=False)
        self.beta_scale = 2.0 if config.linear_allow_neg_eigval else 1.0

    def _split_projections(self, hidden: torch.Tensor):
        """hidden [T, H] -> mixed_qkv [T, conv_dim], z [T, HV, dv], b [T, HV], a [T, HV]."""
        mixed = torch.cat([self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)], dim=-1)
        z = self.g_proj(hidden).view(-1, self.num_v_heads, self.head_v_dim)
        return mixed, z, self.b_proj(hidden), self.a_proj(hidden)


class OlmoAttention(PagedAttention):
    """Attention whose q_norm / k_norm span all heads' features (applied before the head split)."""

    def __init__(self, config):
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        super().__init__(config.hidden_size, heads, kv_heads, head_dim, qkv_bias=config.attention_bias,
                         o_bias=config.attention_bias)
        self.q_norm = RMSNorm(heads * head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(kv_heads * head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden, rope, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], rope (cos, sin) or None (NoPE) -> [T, H]."""
        T = hidden.shape[0]
        q = self.q_norm(self.q_proj(hidden)).view(T, self.num_heads, self.head_dim)
        k = self.k_norm(self.k_proj(hidden)).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(T, self.num_kv_heads, self.head_dim)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        ops.write_kv(k, v, kv_cache, batch.slot_mapping)
        out = ops.paged_attention(
            q.contiguous(), kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
            self.scale, causal=True,
            max_query_len=max(batch.query_lens_cpu) if batch.query_lens_cpu else None,
            max_seq_len=max(batch.seq_lens_cpu) if batch.seq_lens_cpu else None)
        return self.rank_sum(self.o_proj(out.reshape(T, self.num_heads * self.head_dim)))


class OlmoHybridLayer(nn.Module):
    """GDN layer: h + linear_attn(input_layernorm(h)), then h + mlp(post_attention_layernorm(h)).
    Attention layer: h + post_attention_layernorm(self_attn(h)), then
    h + post_feedforward_layernorm(mlp(h))."""

    def __init__(self, config, i: int):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.is_attention = _layer_kind(config, i) == "full_attention"
        if self.is_attention:
            self.self_attn = OlmoAttention(config)
            self.post_feedforward_layernorm = RMSNorm(h, eps=eps)
        else:
            self.linear_attn = OlmoGDN(config)
            self.input_layernorm = RMSNorm(h, eps=eps)
        self.post_attention_layernorm = RMSNorm(h, eps=eps)
        self.mlp = GatedMLP(h, config.intermediate_size, act=config.hidden_act)

    def cache_spec(self, dtype: torch.dtype) -> LayerSpec:
        return self.self_attn.spec(dtype) if self.is_attention else self.linear_attn.cache_spec(dtype)

    def forward(self, h, rope, batch: ForwardBatch, caches: ModelCaches, i: int, split) -> torch.Tensor:
        if self.is_attention:
            h = h + self.post_attention_layernorm(self.self_attn(h, rope, batch, caches.kv[i]))
            return h + self.post_feedforward_layernorm(self.mlp(h))
        h = h + self.linear_attn(self.input_layernorm(h), batch, caches.conv[i], caches.state[i], split)
        return h + self.mlp(self.post_attention_layernorm(h))


class _Body(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(OlmoHybridLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class OlmoHybridModel(HybridModel):
    """Parameter names equal the HF checkpoint's except the GDN's `norm` / `out_proj` (`o_norm` /
    `o_proj` there)."""

    architecture = ARCHITECTURE

    def __init__(self, config):
        super().__init__(config)
        self.model = _Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        attn = next((layer.self_attn for layer in self.model.layers if layer.is_attention), None)
        self.rotary = RotaryEmbedding(config, attn.head_dim) if attn is not None and _has_rope(config) else None

    def checkpoint_name(self, name: str) -> str | None:
        return renamed(name, _RENAMES)

    def load_weights(self, ckpt) -> None:
        """Published names (PublishedNamesView) or transformers' in-memory ones."""
        super().load_weights(PublishedNamesView(ckpt))

    def cache_specs(self) -> dict[int, LayerSpec]:
        return {i: layer.cache_spec(self.dtype) for i, layer in enumerate(self.model.layers)}

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        rope = self.rotary(batch.positions) if self.rotary is not None else None
        split = split_decode_prefill(batch)  # one decode/prefill split shared by all GDN layers
        h = self.model.embed_tokens(batch.input_ids)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, rope, batch, caches, i, split)
        return self.compute_logits(self.model.norm(h), batch, self.lm_head)


MODEL_CLASS = OlmoHybridModel
