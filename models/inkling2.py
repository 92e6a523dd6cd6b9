"""Inkling 2 (the text model): Inkling's relative-bias attention with short convs, reworked
(models/inkling2_attention.py), and "block attention residuals" between layers.

`config.layer_types[i]` is "hybrid_sliding" (window `sliding_window_size`, `swa_*` heads, static
k/v convs) or "hybrid" (full attention, log scaling, per-token k/v conv taps). Memory per layer as
Inkling's: KV pages under cache key i; under key `num_hidden_layers + i` one float32 window of the
four short convs, channels [k | v | post-attention | post-feed-forward], `[2 kv width + 2 hidden,
K - 1]`. Everything else a layer reads is the same token's: as transformers' Inkling2TextModel,
the inputs of every `n_layers_per_attn_res_block`-th layer are kept as "blocks", and each layer's
attention input (three of them, q / k / v, on full layers), its feed-forward input and the final
norm's input are a softmax mix, over the blocks and the running state (unweighted-RMS-normed),
with learned queries (`attention_input`, `mlp_input`, `final_input`). Feed-forward: sigmoid-routed
top-k experts (weights renormalised, times route_scale) with a softcapped SwiGLU
(softcap(gate) * sigmoid(gate) * softcap(up)); logits softcapped by `final_logit_softcapping`.
Published `Inkling2ForConditionalGeneration` checkpoints serve their text model (the vision tower
unused). Numbers follow transformers in float32; in bfloat16 its norms multiply the weight before the cast
and ours after, so bfloat16 runs are close, not identical. Tensor parallelism is refused.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kernels import ops
from hybridkv.specs import LayerSpec, RecurrentSpec

from .base import HybridModel
from .forward_batch import ForwardBatch, ModelCaches
from .inkling import NormedEmbedding
from .inkling2_attention import Inkling2Attention, unweighted_rms_norm
from .inkling2_names import Inkling2CheckpointView
from .inkling_attention import InklingShortConv
from .moe import StackedExperts
from .norms import RMSNorm

ARCHITECTURE = "Inkling2ForCausalLM"
KINDS = ("hybrid", "hybrid_sliding")
_FP32 = ("e_score_correction_bias", "mlp.gate.weight", "_convolution.conv1d.weight", "sconv.conv1d.weight",
         "attention_input.query", "mlp_input.query", "final_input.query", "message_input.query",
         "message_gate_proj.weight", "forget_gate_proj.weight")  # transformers keeps these float32


def tiny_config(**overrides):
    """A 4-layer Inkling2TextConfig: sliding, full, sliding, full (blocks of 2 layers); window 24
    with 2 heads of 32 over 1 KV head, full layers 4 heads of 16 over 2; relative extent 40, log
    scaling from position 16; 4 experts, top 2; softcaps low enough to bite; vocabulary 128 (a
    head of 128 rows, the embeddings padded to 136)."""
    from transformers.models.inkling2.configuration_inkling2 import Inkling2TextConfig

    kw = dict(vocab_size=136, unpadded_vocab_size=128, hidden_size=64, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, swa_num_attention_heads=2,
              swa_num_key_value_heads=1, swa_head_dim=32, sliding_window_size=24, d_rel=8, rel_extent=40,
              log_scaling_n_floor=16, log_scaling_alpha=0.5, layer_types=["hybrid_sliding", "hybrid"] * 2,
              n_layers_per_attn_res_block=2, moe_intermediate_size=32, n_routed_experts=4,
              num_experts_per_tok=2, route_scale=2.0, qk_l2_clip_threshold=3.0, rel_l2_clip_threshold=1.0,
              mlp_gate_softcap=1.0, mlp_up_softcap=2.0, final_logit_softcapping=3.0,
              max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.1, pad_token_id=0,
              bos_token_id=1, eos_token_id=2, architectures=[ARCHITECTURE])
    kw.update(overrides)
    return Inkling2TextConfig(**kw)


def text_model_config(config):
    """The text model's config: a published `...ForConditionalGeneration` config nests it."""
    return getattr(config, "text_config", None) or config


class BlockAttentionResidual(nn.Module):
    """blocks [T, n, H], the running state [T, H] -> `num_queries` tensors [T, H] float32: per
    token, learned queries attend over the unweighted-RMS-normed stack (keys = values)."""

    def __init__(self, hidden: int, num_queries: int = 1):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(hidden) if num_queries == 1 else torch.zeros(num_queries, hidden))

    def forward(self, blocks: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        stacked = unweighted_rms_norm(torch.cat([blocks, state[:, None]], dim=1).float(), 1e-6)
        H = stacked.shape[-1]
        scores = torch.einsum("qh,tnh->tqn", self.query.float().view(-1, H), stacked) * H ** -0.5
        return torch.einsum("tqn,tnh->tqh", torch.softmax(scores, dim=-1, dtype=torch.float32), stacked).unbind(1)


class Inkling2Router(nn.Module):
    """`mlp.gate`: x [T, H] -> (weights [T, k] float32, expert ids [T, k])."""

    def __init__(self, config):
        super().__init__()
        from transformers.activations import ACT2FN

        self.top_k, self.scale = config.num_experts_per_tok, float(config.route_scale)
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))
        self.score_fn = ACT2FN[config.scoring_func]

    def forward(self, x: torch.Tensor):
        scores = self.score_fn(F.linear(x.float(), self.weight.float()))
        ids = torch.topk(scores + self.e_score_correction_bias.float(), self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scale, ids


class Inkling2MoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate = Inkling2Router(config)
        self.experts = StackedExperts(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size)
        self.caps = (float(config.mlp_gate_softcap), float(config.mlp_up_softcap))

    def _glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """softcap(gate) * sigmoid(gate) * softcap(up), in float32 (the sigmoid sees the raw gate)."""
        (cg, cu), g, u = self.caps, gate.float(), up.float()
        return (torch.tanh(g / cg) * cg * torch.sigmoid(g) * (torch.tanh(u / cu) * cu)).to(gate.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return ops.fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids, glu=self._glu)


class MessageGate(nn.Module):
    """`*_message_gate` of a looped layer (Inkling 2 Loop): (1 - forget) * h + gain * message, both
    gates tanh of projections of [rmsnorm(h) | rmsnorm(message)] through a rank `loop_gate_rank`."""

    def __init__(self, config):
        super().__init__()
        h, rank = config.hidden_size, config.loop_gate_rank
        self.eps = config.rms_norm_eps
        self.down_proj = nn.Linear(2 * h, rank, bias=False)
        self.forget_gate_proj = nn.Linear(rank, h, bias=False)
        self.message_gate_proj = nn.Linear(rank, h, bias=False)

    def forward(self, h: torch.Tensor, message: torch.Tensor) -> torch.Tensor:
        h, message = h.float(), message.float()
        g = torch.cat([unweighted_rms_norm(h, self.eps), unweighted_rms_norm(message, self.eps)], dim=-1)
        g = self.down_proj(g.to(self.down_proj.weight.dtype)).float()
        forget = torch.tanh(F.linear(g, self.forget_gate_proj.weight.float()))
        gain = torch.tanh(F.linear(g, self.message_gate_proj.weight.float()))
        return (1 - forget) * h + gain * message


class Inkling2DecoderLayer(nn.Module):
    """One layer; `looped` (Inkling 2 Loop's re-applied layers) adds the message gates that mix the
    previous pass's messages into the attention inputs and the feed-forward input."""

    def __init__(self, config, i: int, looped: bool = False):
        super().__init__()
        self.kind = config.layer_types[i]
        if self.kind not in KINDS:
            raise ValueError(f"layer_types[{i}] is {self.kind!r}; Inkling 2 layers are one of {KINDS}")
        sliding = self.kind == "hybrid_sliding"
        h, eps, k = config.hidden_size, config.rms_norm_eps, config.conv_kernel_size
        self.is_block_boundary = i % config.n_layers_per_attn_res_block == 0
        self.attention_input = BlockAttentionResidual(h, 1 if sliding else 3) if i > 0 else None
        self.mlp_input = BlockAttentionResidual(h)
        self.self_attn = Inkling2Attention(config, sliding)
        self.mlp = Inkling2MoE(config)
        if sliding:
            self.input_layernorm = RMSNorm(h, eps=eps)
        else:
            self.q_input_layernorm = RMSNorm(h, eps=eps)
            self.k_input_layernorm = RMSNorm(h, eps=eps)
            self.v_input_layernorm = RMSNorm(h, eps=eps)
        self.post_attention_layernorm = RMSNorm(h, eps=eps)
        self.post_attention_convolution = InklingShortConv(h, k, divisor=math.sqrt(k + 1))
        self.post_mlp_convolution = InklingShortConv(h, k, divisor=math.sqrt(k + 1))
        if looped:
            self.q_message_gate, self.k_message_gate = MessageGate(config), MessageGate(config)
            self.v_message_gate, self.mlp_message_gate = MessageGate(config), MessageGate(config)

    def conv_spec(self) -> RecurrentSpec:
        """The four conv windows, channels [k | v | post-attention | post-feed-forward], float32."""
        kv, h = self.self_attn.kv_width, self.post_attention_convolution.channels
        return RecurrentSpec(conv_shape=(2 * kv + 2 * h, self.post_attention_convolution.kernel_size - 1),
                             state_shape=(), dtype=torch.float32)

    def forward(self, h: torch.Tensor, blocks: torch.Tensor, batch: ForwardBatch, kv_cache, windows,
                messages: torch.Tensor | None = None):
        """h [T, H] this layer's input, blocks [T, n, H] -> [T, H]; windows [S, 2 kv + 2 H, K - 1];
        messages [T, 4, H] (q, k, v, feed-forward) in a looped layer's later passes, else None."""
        dtype, kv, H = h.dtype, self.self_attn.kv_width, h.shape[1]
        inputs = (h,) * 3 if self.attention_input is None else self.attention_input(blocks, h)
        if messages is not None:  # q, k, v inputs from the one (sliding) or three (full) mixes
            inputs = inputs * 3 if len(inputs) == 1 else inputs
            inputs = [gate(x, m) for gate, x, m in zip(
                (self.q_message_gate, self.k_message_gate, self.v_message_gate), inputs, messages.unbind(1))]
        if self.kind == "hybrid_sliding" and messages is None:
            xq = xk = xv = self.input_layernorm(inputs[0]).to(dtype)
        elif self.kind == "hybrid_sliding":
            xq, xk, xv = (self.input_layernorm(x).to(dtype) for x in inputs)
        else:
            xq = self.q_input_layernorm(inputs[0]).to(dtype)
            xk = self.k_input_layernorm(inputs[1]).to(dtype)
            xv = self.v_input_layernorm(inputs[2]).to(dtype)
        x = self.self_attn(xq, xk, xv, batch, kv_cache, windows[:, :kv], windows[:, kv:2 * kv])
        x = self.post_attention_convolution(x, windows[:, 2 * kv:2 * kv + H], batch).float()
        if self.is_block_boundary:
            residual, blocks = x, torch.cat([blocks, h[:, None]], dim=1)
        else:
            residual = x = h.float() + x
        x = self.mlp_input(blocks, x)[0]
        if messages is not None:
            x = self.mlp_message_gate(x, messages[:, 3])
        x = self.mlp(self.post_attention_layernorm(x).to(dtype))
        x = self.post_mlp_convolution(x, windows[:, 2 * kv + H:], batch)
        return (residual + x).to(dtype)


class Inkling2Body(nn.Module):
    """`model`: the embeddings, the layers (those in `looped` with message gates), final mix and norm."""

    def __init__(self, config, looped: range = range(0)):
        super().__init__()
        self.embed_tokens = NormedEmbedding(config.vocab_size, config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(Inkling2DecoderLayer(config, i, looped=i in looped)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.final_input = BlockAttentionResidual(config.hidden_size)


class Inkling2Model(HybridModel):
    """Parameter names equal transformers'. Cache keys: i (KV), num_hidden_layers + i (conv windows)."""

    architecture = ARCHITECTURE

    def __init__(self, config, body: nn.Module | None = None):
        config = text_model_config(config)
        super().__init__(config)
        self.model = body or Inkling2Body(config)
        self.vocab_size = int(config.unpadded_vocab_size)
        self.lm_head = nn.Linear(config.hidden_size, self.vocab_size, bias=False)
        self.softcap = float(config.final_logit_softcapping)

    def tied_weights(self) -> dict[str, str]:
        return {}  # transformers: embed and unembed are separate tensors, never tied

    @torch.no_grad()
    def load_weights(self, ckpt) -> None:
        """The checkpoint's tensors under the published names (or transformers' in-memory ones);
        those transformers keeps in float32 re-read in float32."""
        ckpt = Inkling2CheckpointView(ckpt, self.vocab_size)
        super().load_weights(ckpt)
        for name, t in [*self.named_parameters(), *self.named_buffers()]:
            if name.endswith(_FP32) and t.dtype != torch.float32:
                t.data = ckpt.get(name).to(device=t.device, dtype=torch.float32)

    def cache_specs(self) -> dict[int, LayerSpec]:
        n, dtype = len(self.model.layers), self.dtype
        specs: dict[int, LayerSpec] = {i: layer.self_attn.spec(dtype) for i, layer in enumerate(self.model.layers)}
        specs.update({n + i: layer.conv_spec() for i, layer in enumerate(self.model.layers)})
        return specs

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        body, n = self.model, len(self.model.layers)
        h = body.embed_tokens(batch.input_ids)
        dtype = h.dtype
        blocks = h.new_zeros(h.shape[0], 0, h.shape[1])
        for i, layer in enumerate(body.layers):
            new = layer(h, blocks, batch, caches.kv[i], caches.conv[n + i])
            if layer.is_block_boundary:
                blocks = torch.cat([blocks, h[:, None]], dim=1)
            h = new
        h = body.norm(body.final_input(blocks, h)[0]).to(dtype)
        logits = self.compute_logits(h, batch, self.lm_head)
        return torch.tanh(logits / self.softcap) * self.softcap


MODEL_CLASS = Inkling2Model
