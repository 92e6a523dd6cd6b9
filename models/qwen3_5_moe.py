"""Qwen3.5-MoE (text): Qwen3.5's layers (qwen3_5.py) with a sparse MoE in every layer.

The MoE routes top-k of a float32 softmax and always renormalises the k weights (Qwen3.5-MoE has
no `norm_topk_prob` option), plus a shared expert scaled by sigmoid(shared_expert_gate(x)).
Published (multimodal) checkpoints load as the text model alone, as for Qwen3.5.
"""
from __future__ import annotations

from torch import nn

from .moe import SparseMoE, published_router_name
from .qwen3_5 import Qwen3_5Model

ARCHITECTURE = "Qwen3_5MoeForCausalLM"


def tiny_config(**overrides):
    """A 4-layer Qwen3_5MoeTextConfig: GDN, attention, GDN, attention; MoE (4 experts, top-2,
    shared expert) in every layer."""
    from transformers import Qwen3_5MoeTextConfig

    kw = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, layer_types=["linear_attention", "full_attention"] * 2,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
              max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.1,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
              architectures=[ARCHITECTURE])
    kw.update(overrides)
    return Qwen3_5MoeTextConfig(**kw)


def moe_mlp(config, i: int) -> nn.Module:
    return SparseMoE(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                     config.num_experts_per_tok, norm_topk_prob=True,
                     shared_intermediate_size=config.shared_expert_intermediate_size,
                     act=config.hidden_act)


class Qwen3_5MoeModel(Qwen3_5Model):
    """Parameter names equal the HF checkpoint's, except the router: ours `mlp.router`, the
    checkpoint's `mlp.gate` (mapped in `checkpoint_name`); experts load per expert or fused
    (Qwen3_5Model.load_weights)."""

    architecture = ARCHITECTURE

    def __init__(self, config, with_mtp: bool = False):
        super().__init__(config, make_mlp=moe_mlp, with_mtp=with_mtp)

    def checkpoint_name(self, name: str) -> str | None:
        return published_router_name(name)


MODEL_CLASS = Qwen3_5MoeModel
