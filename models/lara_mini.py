"""Lara Mini (Lara-4-Mini): Qwen3.5's gated delta net beside sliding-window AND full attention, MoE.

`config.layer_types[i]` is "linear_attention" (GDN: a conv window and a state per slot),
"sliding_attention" (window `sliding_window`) or "full_attention": three kinds of layer memory
in one model (GDN slots and two KV groups). Differences from Qwen3.5-MoE, as transformers'
LaraMini:
- plain RMSNorms (weight, not 1 + weight), the weight applied in float32 before the cast back;
- attention is Qwen3's (q_norm / k_norm per head, no output gate); rope on the sliding layers
  only, over the whole head; the full-attention layers use no positional encoding at all;
- the router's logits are computed in float32; the shared expert is added in full, ungated.
Published checkpoints fuse the GDN input projections into one `linear_attn.in_proj` (rows
q|k|v|z|b|a) and name its gated norm `out_norm`; both layouts load (LaraMiniCheckpointView).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kernels import ops
from hybridkv.specs import LayerSpec

from .attention import PagedAttention
from .base import HybridModel
from .checkpoint import CheckpointError
from .decoder import HybridDecoderLayer, layer_cache_specs
from .forward_batch import ForwardBatch, ModelCaches
from .moe import PerExpertView, SparseMoE, published_router_name
from .norms import RMSNorm
from .qwen3_5 import SplitProjectionGDN
from .rotary import RotaryEmbedding
from .slot_split import split_decode_prefill

ARCHITECTURE = "LaraMiniForCausalLM"
KINDS = ("linear_attention", "sliding_attention", "full_attention")


def tiny_config(**overrides):
    """A 5-layer LaraMiniConfig in the released period-5 pattern: GDN, sliding, GDN, full,
    sliding; window 24 (one and a half blocks of 16); GDN with 2 key heads serving 4 value heads;
    MoE (4 experts, top-2, ungated shared expert) in every layer; tied embeddings."""
    from transformers import LaraMiniConfig

    kw = dict(vocab_size=128, hidden_size=64, num_hidden_layers=5, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, sliding_window=24,
              layer_types=["linear_attention", "sliding_attention", "linear_attention",
                           "full_attention", "sliding_attention"],
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
              max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.1,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
              architectures=[ARCHITECTURE])
    kw.update(overrides)
    return LaraMiniConfig(**kw)


def refuse_unsupported(config) -> None:
    """CheckpointError naming the first option this module would run differently from transformers."""
    for i, kind in enumerate(config.layer_types):
        if kind not in KINDS:
            raise CheckpointError(f"LaraMini layer_types[{i}] is {kind!r}; supported: {list(KINDS)}")
    if len(config.layer_types) != config.num_hidden_layers:
        raise CheckpointError(f"LaraMini layer_types has {len(config.layer_types)} entries but "
                              f"num_hidden_layers is {config.num_hidden_layers}; give one per layer")
    if config.hidden_act != "silu":
        raise CheckpointError(f"LaraMini hidden_act={config.hidden_act!r} is not supported; only 'silu'")
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise CheckpointError(f"LaraMini rope_parameters.rope_type={rope['rope_type']!r} is not "
                              f"supported; only 'default'")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:  # transformers rotates the whole head
        raise CheckpointError(f"LaraMini rope_parameters.partial_rotary_factor="
                              f"{rope['partial_rotary_factor']!r} is not supported; only 1.0")
    if not 0 < config.num_experts_per_tok <= config.num_experts:
        raise CheckpointError(f"LaraMini num_experts_per_tok={config.num_experts_per_tok} must be in "
                              f"[1, num_experts={config.num_experts}]")


class Float32WeightRMSNorm(RMSNorm):
    """x [..., dim] -> (w * x / rms(x)) all in float32, then cast back (transformers' LaraMiniRMSNorm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


class UngatedSharedExpertMoE(SparseMoE):
    """Top-k of a float32 softmax over float32 router logits, renormalised when `norm_topk_prob`,
    plus the shared expert added in full (no `shared_expert_gate`)."""

    def __init__(self, config):
        super().__init__(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                         config.num_experts_per_tok, norm_topk_prob=config.norm_topk_prob,
                         shared_intermediate_size=config.shared_expert_intermediate_size,
                         act=config.hidden_act)
        self.shared_expert_gate = None

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden.float(), self.router.weight.float())
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(hidden)
        out = ops.fused_moe(hidden, self.experts.gate_up_proj, self.experts.down_proj,
                            weights.to(hidden.dtype), ids, self.act)
        if self.shared_expert is not None:
            out = out + self.shared_expert(hidden)
        return self.rank_sum(out)


class LaraMiniDecoderLayer(HybridDecoderLayer):
    """`linear_attn` (GDN) or `self_attn` after `input_layernorm`, residual; `mlp` (MoE) after
    `post_attention_layernorm`, residual (HF names)."""

    mixer_norm, recurrent = "input_layernorm", "linear_attn"
    ff_norm, ff = "post_attention_layernorm", "mlp"

    def __init__(self, config, i: int):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.kind = config.layer_types[i]
        if self.kind == "linear_attention":
            self.linear_attn = SplitProjectionGDN.from_config(config)
        else:
            self.self_attn = PagedAttention(
                h, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                qk_norm=lambda d: Float32WeightRMSNorm(d, eps=eps),
                sliding_window=config.sliding_window if self.kind == "sliding_attention" else None)
        self.mlp = UngatedSharedExpertMoE(config)
        self.input_layernorm = Float32WeightRMSNorm(h, eps=eps)
        self.post_attention_layernorm = Float32WeightRMSNorm(h, eps=eps)


class LaraMiniCheckpointView:
    """A checkpoint seen with transformers' in-memory names: the published fused
    `linear_attn.in_proj.weight` (rows q|k|v|z|b|a) split into `in_proj_qkv`, `in_proj_z`,
    `in_proj_b`, `in_proj_a`, and `linear_attn.out_norm` read as `linear_attn.norm`. `rows` gives
    each split's row count. Wraps anything with `__contains__` and `get(name)`."""

    _SPLITS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

    def __init__(self, ckpt, rows: tuple[int, int, int, int]):
        self.ckpt, self.rows = ckpt, rows

    def _source(self, name: str):
        """(stored name, row slice or None) for `name`."""
        if name in self.ckpt:
            return name, None
        if ".linear_attn.norm." in name:
            return name.replace(".linear_attn.norm.", ".linear_attn.out_norm."), None
        for k, split in enumerate(self._SPLITS):
            if f".linear_attn.{split}." in name:
                start = sum(self.rows[:k])
                return (name.replace(f".linear_attn.{split}.", ".linear_attn.in_proj."),
                        slice(start, start + self.rows[k]))
        return name, None

    def __contains__(self, name: str) -> bool:
        return self._source(name)[0] in self.ckpt

    def get(self, name: str) -> torch.Tensor:
        source, rows = self._source(name)
        t = self.ckpt.get(source)
        if rows is None:
            return t
        if t.shape[0] != sum(self.rows):
            raise CheckpointError(f"{source} has {t.shape[0]} rows; the config's GDN needs "
                                  f"{sum(self.rows)} (q|k|v|z|b|a = {self.rows})")
        return t[rows]


class _LaraMiniBody(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LaraMiniDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Float32WeightRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class LaraMiniModel(HybridModel):
    """Parameter names equal transformers' in-memory names except the router (ours `mlp.router`,
    the checkpoint's `mlp.gate`); fused or per-expert experts and the fused GDN `in_proj` load."""

    architecture = ARCHITECTURE

    def __init__(self, config):
        refuse_unsupported(config)
        super().__init__(config)
        self.model = _LaraMiniBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        sliding = "sliding_attention" in config.layer_types
        self.rotary = RotaryEmbedding(config, config.head_dim) if sliding else None

    def checkpoint_name(self, name: str) -> str | None:
        return published_router_name(name)

    def load_weights(self, ckpt) -> None:
        c = self.config
        key, value = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
        rows = (2 * key + value, value, c.linear_num_value_heads, c.linear_num_value_heads)
        super().load_weights(PerExpertView(LaraMiniCheckpointView(ckpt, rows)))

    def cache_specs(self) -> dict[int, LayerSpec]:
        return layer_cache_specs(self.model.layers, self.dtype)

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        rope = self.rotary(batch.positions) if self.rotary is not None else None  # once per step
        split = split_decode_prefill(batch)
        h = self.model.embed_tokens(batch.input_ids)
        for i, layer in enumerate(self.model.layers):
            # the full-attention layers use no positional encoding
            h = layer(h, rope if layer.kind == "sliding_attention" else None, batch, caches, i, split)
        return self.compute_logits(self.model.norm(h), batch, self.lm_head)


MODEL_CLASS = LaraMiniModel
