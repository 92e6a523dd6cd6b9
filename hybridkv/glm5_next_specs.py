"""The planner's builder for GLM-5-Next (glm5_next_text, and the multimodal glm5_next config whose
`text_config` nests it), in a module of its own to keep config_specs.py one screenful of builders.

Per layer i: "linear_attention" (KDA) one state slot, conv window over q|k|v `[3 x linear_num_heads
x linear_head_dim, linear_conv_kernel_dim - 1]` and the delta-rule state `[heads, head_dim,
head_dim]` in float32; "indexed_attention" (DSA) latent pages of kv_lora_rank per token at key i
and, where `indexer_types[i]` is "full", the indexer's pages at key `num_hidden_layers + i` (one
head of index_head_dim: key part the indexer key, value part the k-pool gate scores).
"""
from __future__ import annotations

import torch

from hybridkv.specs import AttentionSpec, LayerSpec, RecurrentSpec


def glm5_next_specs(c, dtype: torch.dtype) -> dict[int, LayerSpec]:
    """`c`: transformers' Glm5NextConfig or Glm5NextTextConfig -> {cache key: spec} in `dtype`."""
    c = getattr(c, "text_config", None) or c
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
            raise ValueError(f"glm5_next layer {i} has type {kind!r}; expected one of "
                             f"['indexed_attention', 'linear_attention']")
    return specs
