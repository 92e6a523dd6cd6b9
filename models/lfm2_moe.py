"""LFM2-MoE: LFM2's gated short-conv and attention layers, a dense SwiGLU feed-forward in the first
`num_dense_layers` layers and a sparse MoE in the others.

The MoE routes as transformers' Lfm2MoeTopKRouter: sigmoid of the router logits; the top-k are
picked on sigmoid + `expert_bias` (a per-expert load-balancing bias) when `use_expert_bias`, but
weighted by the plain sigmoid; the k weights renormalised (sum + 1e-6) when `norm_topk_prob`; then
times `routed_scaling_factor`. The experts run through models/moe.py's stacked experts.
Published checkpoints store experts one by one (`experts.E.w1/w3/w2`: gate, up, down); transformers'
in-memory state dict stacks them (`experts.gate_up_proj`, `experts.down_proj`): both load.
"""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.kernels import ops

from .lfm2 import LFM2_RENAMES
from .lfm2 import Lfm2DecoderLayer, Lfm2Model
from .mlp import GatedMLP
from .moe import SparseMoE

ARCHITECTURE = "Lfm2MoeForCausalLM"
LFM2_MOE_RENAMES = {**LFM2_RENAMES, ".feed_forward.router.": ".feed_forward.gate."}


def tiny_config(**overrides):
    """A 4-layer Lfm2MoeConfig (conv, conv, attention, conv): a dense feed-forward in layer 0, MoE
    (4 experts, top-2, expert bias, routed_scaling_factor 1.5) in layers 1-3; tied embeddings."""
    from transformers import Lfm2MoeConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              layer_types=["conv", "conv", "full_attention", "conv"], conv_L_cache=3, conv_bias=False,
              num_dense_layers=1, num_experts=4, num_experts_per_tok=2, use_expert_bias=True,
              routed_scaling_factor=1.5, norm_topk_prob=True, max_position_embeddings=512,
              norm_eps=1e-5, initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=True, architectures=[ARCHITECTURE])
    kw.update(overrides)
    return Lfm2MoeConfig(**kw)


class Lfm2SparseMoE(SparseMoE):
    """hidden [T, H] -> [T, H] with LFM2-MoE's sigmoid routing (module docstring); `expert_bias`
    [E] float32 is a checkpoint buffer."""

    def __init__(self, config):
        super().__init__(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                         config.num_experts_per_tok, norm_topk_prob=config.norm_topk_prob)
        self.routed_scaling_factor = float(config.routed_scaling_factor)
        self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32)
                             if config.use_expert_bias else None)

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> (weights [T, k], expert ids [T, k] long)."""
        probs = torch.sigmoid(self.router(hidden))
        if self.expert_bias is not None:
            ids = torch.topk(probs + self.expert_bias, self.top_k, dim=-1).indices
            weights = torch.gather(probs, 1, ids)
        else:
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
        return weights * self.routed_scaling_factor, ids

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(hidden)
        return self.rank_sum(ops.fused_moe(hidden, self.experts.gate_up_proj, self.experts.down_proj,
                                           weights.to(hidden.dtype), ids, self.act))


class Lfm2MoeDecoderLayer(Lfm2DecoderLayer):
    """LFM2's block (operator_norm -> conv / self_attn, ffn_norm -> feed_forward) with a dense
    feed-forward in the first `num_dense_layers` layers and the MoE in the others."""

    family = "LFM2-MoE"

    def make_feed_forward(self, config, i: int) -> nn.Module:
        return (GatedMLP(config.hidden_size, config.intermediate_size, bias=False, act="silu")
                if i < config.num_dense_layers else Lfm2SparseMoE(config))


class _ExpertsView:
    """A checkpoint seen with the stacked expert names (`feed_forward.experts.gate_up_proj`
    [E, 2I, H] = w1 | w3, `feed_forward.experts.down_proj` [E, H, I] = w2) when it stores the
    published per-expert tensors."""

    _PARTS = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}

    def __init__(self, ckpt):
        self.ckpt = ckpt

    def _per_expert(self, name: str):
        head, sep, tail = name.rpartition(".experts.")
        if not sep or tail not in self._PARTS or name in self.ckpt:
            return None
        prefix, parts = f"{head}.experts", self._PARTS[tail]
        return (prefix, parts) if f"{prefix}.0.{parts[0]}.weight" in self.ckpt else None

    def __contains__(self, name: str) -> bool:
        return name in self.ckpt or self._per_expert(name) is not None

    def get(self, name: str) -> torch.Tensor:
        found = self._per_expert(name)
        if found is None:
            return self.ckpt.get(name)  # the checkpoint's own "missing tensor" error
        prefix, parts = found
        stacked, e = [], 0
        while f"{prefix}.{e}.{parts[0]}.weight" in self.ckpt:
            stacked.append(torch.cat([self.ckpt.get(f"{prefix}.{e}.{p}.weight") for p in parts]))
            e += 1
        return torch.stack(stacked)


class Lfm2MoeModel(Lfm2Model):
    """Parameter names as Lfm2Model's, plus the router (ours `feed_forward.router`, the
    checkpoint's `feed_forward.gate`) and stacked experts (`_ExpertsView`)."""

    architecture = ARCHITECTURE
    layer_class = Lfm2MoeDecoderLayer
    checkpoint_renames = LFM2_MOE_RENAMES

    def load_weights(self, ckpt) -> None:
        super().load_weights(_ExpertsView(ckpt))


MODEL_CLASS = Lfm2MoeModel
