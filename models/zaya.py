"""Zaya (ZAYA1): every layer is CCA attention (models/zaya_attention.py) plus a top-1 MoE whose
router carries a state from layer to layer.

`config.layer_types[i]` is "hybrid" (full attention) or "hybrid_sliding" (window
`sliding_window`); each type has its own rope (`rope_parameters[type]`, partial by default). A
layer keeps two things per request: KV pages under cache key i (its attention group by window)
and, under key `num_hidden_layers + i`, the CCA conv window and delayed value in a state slot
(RecurrentMemory; the keys follow Falcon-H1's two-per-layer layout). As transformers' Zaya:
- the residual stream is float32: embeddings go through `input_hidden_states_{bias,scale}`
  ((e + bias) * scale), and each branch joins it through a learned affine residual
  ((branch + b) * s + (residual + b') * s', `post_{attention,mlp}_residual_scale`);
- router: down_proj to `router_hidden_size`, plus (from layer 1 on) the previous layer's router
  hidden state times `router_states_scale` (a state across layers within a token, not across
  tokens); an RMSNorm -> gelu MLP -> softmax over experts + 1 "skip" class; the top-1 choice is
  made on probabilities plus `balancing_biases`, weighted by the unbiased probability; the skip
  class contributes nothing (its balancing bias is -1 whatever the checkpoint says: transformers
  5.24 overwrites it after loading, and so does load_weights here);
- experts are SwiGLU (`experts.gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`).
Tensor parallelism is refused (transformers' Zaya declares no TP plan either).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kernels import ops
from hybridkv.specs import LayerSpec

from .base import HybridModel
from .forward_batch import ForwardBatch, ModelCaches
from .lfm3 import LayerTypeRotary
from .moe import StackedExperts
from .norms import RMSNorm
from .rotary import RotaryEmbedding
from .zaya_attention import ZayaAttention

ARCHITECTURE = "ZayaForCausalLM"
KINDS = ("hybrid", "hybrid_sliding")


def tiny_config(**overrides):
    """A 4-layer ZayaConfig: sliding, full, sliding, full; window 24 (one and a half blocks of 16);
    4 query heads over 2 KV heads of 16; 4 experts (+ skip), router width 32; an lm_head of its own
    (tied embeddings, the published default, made greedy runs repeat one token)."""
    from transformers import ZayaConfig

    kw = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, layer_types=["hybrid_sliding", "hybrid"] * 2,
              sliding_window=24, moe_intermediate_size=32, num_experts=4, router_hidden_size=32,
              max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.1,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
              architectures=[ARCHITECTURE])
    kw.update(overrides)
    return ZayaConfig(**kw)


class ResidualScaling(nn.Module):
    """(branch + hidden_states_bias) * hidden_states_scale + (residual + residual_bias) * residual_scale."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.hidden_states_scale = nn.Parameter(torch.ones(hidden_size))
        self.hidden_states_bias = nn.Parameter(torch.zeros(hidden_size))
        self.residual_scale = nn.Parameter(torch.ones(hidden_size))
        self.residual_bias = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, branch: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return ((branch + self.hidden_states_bias) * self.hidden_states_scale
                + (residual + self.residual_bias) * self.residual_scale)


class ZayaRouterMLP(nn.Module):
    def __init__(self, width: int, classes: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(width, eps=eps)
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, classes, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(F.gelu(self.fc2(F.gelu(self.fc1(self.norm(x))))))


class ZayaRouter(nn.Module):
    """`mlp.gate`: x [T, H], the previous layer's router state [T, R] or None -> (weights [T, 1],
    expert ids [T, 1], this layer's router state [T, R])."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        if config.num_experts_per_tok != 1:
            raise ValueError(f"num_experts_per_tok={config.num_experts_per_tok}; Zaya routes each token "
                             f"to one expert (transformers' ZayaConfig allows only 1)")
        self.num_experts = config.num_experts
        self.down_proj = nn.Linear(config.hidden_size, config.router_hidden_size)
        self.use_eda = layer_idx != 0
        if self.use_eda:
            self.router_states_scale = nn.Parameter(torch.ones(config.router_hidden_size))
        self.router_mlp = ZayaRouterMLP(config.router_hidden_size, config.num_experts + 1, config.rms_norm_eps)
        self.register_buffer("balancing_biases", torch.zeros(config.num_experts + 1))

    def forward(self, x: torch.Tensor, prev: torch.Tensor | None):
        state = self.down_proj(x)
        if self.use_eda and prev is not None:
            state = state + prev * self.router_states_scale
        probs = torch.softmax(self.router_mlp(state), dim=-1)
        ids = torch.topk(probs.float() + self.balancing_biases.float(), 1, dim=-1).indices
        weights = torch.gather(probs, 1, ids)
        skip = ids == self.num_experts  # the extra class: no expert runs
        return weights.masked_fill(skip, 0), ids.masked_fill(skip, 0), state


class ZayaMoE(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.gate = ZayaRouter(config, layer_idx)
        self.experts = StackedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.act = config.hidden_act

    def forward(self, x: torch.Tensor, prev: torch.Tensor | None):
        weights, ids, state = self.gate(x, prev)
        out = ops.fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights.to(x.dtype), ids, self.act)
        return out, state


class ZayaDecoderLayer(nn.Module):
    def __init__(self, config, i: int):
        super().__init__()
        self.kind = config.layer_types[i]
        if self.kind not in KINDS:
            raise ValueError(f"layer_types[{i}] is {self.kind!r}; Zaya layers are one of {KINDS}")
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = ZayaAttention(config, config.sliding_window if self.kind == "hybrid_sliding" else None)
        self.mlp = ZayaMoE(config, i)
        self.input_layernorm = RMSNorm(h, eps=eps)
        self.post_attention_layernorm = RMSNorm(h, eps=eps)
        self.post_attention_residual_scale = ResidualScaling(h)
        self.post_mlp_residual_scale = ResidualScaling(h)

    def forward(self, h: torch.Tensor, router_state, rope, batch: ForwardBatch, kv_cache, conv_pool, v_pool):
        """h [T, H] float32 residual stream -> (h, this layer's router state)."""
        dtype = self.input_layernorm.weight.dtype
        x = self.self_attn(self.input_layernorm(h.to(dtype)), rope, batch, kv_cache, conv_pool, v_pool)
        h = self.post_attention_residual_scale(x, h)
        x, router_state = self.mlp(self.post_attention_layernorm(h.to(dtype)), router_state)
        return self.post_mlp_residual_scale(x, h), router_state


class _ZayaBody(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.input_hidden_states_scale = nn.Parameter(torch.ones(config.hidden_size))
        self.input_hidden_states_bias = nn.Parameter(torch.zeros(config.hidden_size))
        self.layers = nn.ModuleList(ZayaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class PartialRotary(RotaryEmbedding):
    """Default rope with base `theta` on the first `dim` dims of a head (Zaya's
    compute_default_rope_parameters: dim = int(head_dim * partial_rotary_factor))."""

    def __init__(self, theta: float, dim: int):
        nn.Module.__init__(self)  # RotaryEmbedding's forward on this inv_freq
        self._inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))
        self.scaling, self.rotary_dim = 1.0, 2 * self._inv_freq.numel()


def layer_type_rotary(config, layer_type: str, head_dim: int) -> RotaryEmbedding:
    """The rope of one layer type: PartialRotary for default rope, other types through
    transformers' init functions (LFM3's LayerTypeRotary)."""
    params = config.rope_parameters[layer_type]
    if params.get("rope_type", "default") != "default":
        return LayerTypeRotary(config, layer_type, head_dim)
    return PartialRotary(params["rope_theta"], int(head_dim * params.get("partial_rotary_factor", 1.0)))


class ZayaModel(HybridModel):
    """Parameter names equal transformers'. Cache keys: i (KV), num_hidden_layers + i (CCA state)."""

    architecture = ARCHITECTURE

    def __init__(self, config):
        super().__init__(config)
        self.model = _ZayaBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias)
        kinds = sorted({layer.kind for layer in self.model.layers})
        self.rotary = {k: layer_type_rotary(config, k, config.head_dim) for k in kinds}

    @torch.no_grad()
    def load_weights(self, ckpt) -> None:
        """The checkpoint's tensors; then every router's skip-class balancing bias set to -1, as
        transformers 5.24 does after loading (ZayaPreTrainedModel._init_weights assigns it whatever
        the checkpoint holds), so the engine routes as transformers does."""
        super().load_weights(ckpt)
        for layer in self.model.layers:
            layer.mlp.gate.balancing_biases[-1] = -1.0

    def cache_specs(self) -> dict[int, LayerSpec]:
        n, dtype = len(self.model.layers), self.dtype
        specs: dict[int, LayerSpec] = {i: layer.self_attn.spec(dtype) for i, layer in enumerate(self.model.layers)}
        specs.update({n + i: layer.self_attn.qkv_proj.cache_spec(dtype) for i, layer in enumerate(self.model.layers)})
        return specs

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        ropes = {k: rotary(batch.positions) for k, rotary in self.rotary.items()}  # once per step
        body, n = self.model, len(self.model.layers)
        e = body.embed_tokens(batch.input_ids)
        h = ((e + body.input_hidden_states_bias) * body.input_hidden_states_scale).float()
        router_state = None
        for i, layer in enumerate(body.layers):
            h, router_state = layer(h, router_state, ropes[layer.kind], batch, caches.kv[i],
                                    caches.conv[n + i], caches.state[n + i])
        h = body.norm(h.to(body.norm.weight.dtype))
        return self.compute_logits(h, batch, self.lm_head)


MODEL_CLASS = ZayaModel
