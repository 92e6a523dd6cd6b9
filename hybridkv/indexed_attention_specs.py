"""The planner's builders for the families whose attention layers keep an indexer's own pages beside
their KV (GLM-5-Next's DSA, Qwen4-Exp's QSA), in a module of their own to keep config_specs.py one
screenful of builders. Each takes transformers' config object (config_specs.hf_config builds it;
a multimodal config's `text_config` is used) and the cache dtype.

glm5_next / glm5_next_text, per layer i: "linear_attention" (KDA) one state slot, conv window over
q|k|v `[3 x linear_num_heads x linear_head_dim, linear_conv_kernel_dim - 1]` and the delta-rule
state `[heads, head_dim, head_dim]` in float32; "indexed_attention" (DSA) latent pages of
kv_lora_rank per token at key i and, where `indexer_types[i]` is "full", the indexer's pages at key
`num_hidden_layers + i` (one head of index_head_dim: key part the indexer key, value part the
k-pool gate scores).

qwen4_exp / qwen4_exp_text, per layer i: "linear_attention" (Qwen3.5's GDN) one state slot at key i
and, on `ple_layer_ids` layers, the PLE slot at key `num_hidden_layers + i` (conv window `[hc_count x
hidden, (ple_conv_kernel_size - 1) x ngram_size]`, the last `ngram_size - 1` token ids in float32);
"indexed_attention" KV pages at key i and the QSA indexer's raw keys as latent pages of
indexer_head_dim at key `num_hidden_layers + i`.
"""
from __future__ import annotations

import torch

from hybridkv.specs import AttentionSpec, LayerSpec, RecurrentSpec


def _text(c):
    return getattr(c, "text_config", None) or c


def _unknown(family: str, i: int, kind: str) -> ValueError:
    return ValueError(f"{family} layer {i} has type {kind!r}; expected one of "
                      f"['indexed_attention', 'linear_attention']")


def glm5_next_specs(c, dtype: torch.dtype) -> dict[int, LayerSpec]:
    """`c`: transformers' Glm5NextConfig or Glm5NextTextConfig -> {cache key: spec} in `dtype`."""
    c = _text(c)
    n, h, d = c.num_hidden_layers, c.linear_num_heads, c.linear_head_dim
    kda = RecurrentSpec((3 * h * d, c.linear_conv_kernel_dim - 1), (h, d, d), dtype,
                        None if dtype == torch.float32 else torch.float32)
    specs: dict[int, LayerSpec] = {}
    for i, kind in enumerate(c.layer_types[:n]):
        if kind == "linear_attention":
            specs[i] = kda
        elif kind == "indexed_attention":
            specs[i] = AttentionSpec(1, c.kv_lora_rank + c.qk_rope_head_dim, dtype, latent=True)
            if c.indexer_types[i] == "full":
                specs[n + i] = AttentionSpec(1, c.index_head_dim, dtype)
        else:
            raise _unknown("glm5_next", i, kind)
    return specs


def qwen4_exp_specs(c, dtype: torch.dtype) -> dict[int, LayerSpec]:
    """`c`: transformers' Qwen4ExpConfig or Qwen4ExpTextConfig -> {cache key: spec} in `dtype`."""
    c = _text(c)
    if c.indexer_head_dim is None and "indexed_attention" in c.layer_types:
        raise ValueError("qwen4_exp config has indexed_attention layers but no QSA indexer fields "
                         "(indexer_n_heads, indexer_head_dim, ...); transformers builds an indexer on each")
    n, nk, nv = c.num_hidden_layers, c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    gdn = RecurrentSpec((2 * nk * dk + nv * dv, c.linear_conv_kernel_dim - 1), (nv, dk, dv), dtype)
    ple = RecurrentSpec((c.hc_count * c.hidden_size, (c.ple_conv_kernel_size - 1) * c.ngram_size),
                        (c.ngram_size - 1,), dtype, torch.float32)
    specs: dict[int, LayerSpec] = {}
    for i, kind in enumerate(c.layer_types[:n]):
        if kind == "linear_attention":
            specs[i] = gdn
            if i + 1 in c.ple_layer_ids:
                specs[n + i] = ple
        elif kind == "indexed_attention":
            specs[i] = AttentionSpec(c.num_key_value_heads, c.head_dim, dtype)
            specs[n + i] = AttentionSpec(1, c.indexer_head_dim, dtype, latent=True)
        else:
            raise _unknown("qwen4_exp", i, kind)
    return specs


# model_type -> builder of transformers' config object
BUILDERS = {"glm5_next": glm5_next_specs, "glm5_next_text": glm5_next_specs,
            "qwen4_exp": qwen4_exp_specs, "qwen4_exp_text": qwen4_exp_specs}
