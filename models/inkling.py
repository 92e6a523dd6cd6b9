"""Inkling (v1, the text model): relative-bias attention with short convs (models/inkling_attention.py)
beside sliding-window layers, an MoE with shared experts in the router's normalisation.

`config.layer_types[i]` is "hybrid" (full attention) or "hybrid_sliding" (window
`sliding_window_size`, with its own `swa_*` head shapes). Each layer runs four causal depthwise
short convs (kernel `conv_kernel_size`, float32, input added back): on k and v inside attention
(`k_sconv`, `v_sconv`), on the attention output (`attn_sconv`) and on the feed-forward output
(`mlp_sconv`). A layer keeps its KV pages under cache key i and the four conv windows, packed as
channels [k | v | attention | feed-forward] of one float32 window `[2 kv width + 2 hidden, K - 1]`,
in a state slot under key `num_hidden_layers + i` (RecurrentMemory, no SSM state). As transformers:
- embeddings RMS-normed (`embed_tokens.embed_norm`); final norm, then hidden / logits_mup_width_multiplier
  before `lm_head`; logits cut to `unpadded_vocab_size` when set (the model's vocabulary is then that);
- feed-forward "dense" (SwiGLU times `global_scale`) or "sparse" per `mlp_layer_types`: sigmoid
  router whose top-k (chosen on scores + e_score_correction_bias) and the shared experts' logits
  are normalised together (softmax of their log-sigmoids) times route_scale x global_scale; the
  shared experts take their weights from that normalisation;
- convs, the routing bias and the router's global_scale stay float32 whatever the compute dtype.
Multi-token-prediction layers (`num_mtp_layers`) are not run (transformers ignores their weights
too). Published `InklingForConditionalGeneration` checkpoints serve their text model (the vision
and audio towers unused). Tensor parallelism is refused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kernels import ops
from hybridkv.specs import LayerSpec, RecurrentSpec

from .base import HybridModel
from .forward_batch import ForwardBatch, ModelCaches
from .inkling_attention import InklingAttention, InklingShortConv
from .inkling_names import InklingCheckpointView
from .moe import StackedExperts
from .norms import RMSNorm

ARCHITECTURE = "InklingForCausalLM"
KINDS = ("hybrid", "hybrid_sliding")
_FP32 = ("sconv.conv1d.weight", "gate.e_score_correction_bias", "gate.global_scale")  # transformers keeps these


def tiny_config(**overrides):
    """A 4-layer InklingTextConfig: sliding, full, sliding, full; window 24 (one and a half blocks
    of 16) with 2 heads of 32 over 1 KV head, full layers 4 heads of 16 over 2; relative extent 40
    (shorter than the longest prompts), log scaling (alpha 0.5) from position 16; a dense first layer, then
    MoE (4 experts, top 2, one shared); a head of 136 rows cut to the 128 ids the tests draw from."""
    from transformers.models.inkling.configuration_inkling import InklingTextConfig

    kw = dict(vocab_size=136, unpadded_vocab_size=128, hidden_size=64, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, swa_num_attention_heads=2,
              swa_num_key_value_heads=1, swa_head_dim=32, sliding_window_size=24, d_rel=8, rel_extent=40,
              log_scaling_n_floor=16, log_scaling_alpha=0.5, layer_types=["hybrid_sliding", "hybrid"] * 2,
              mlp_layer_types=["dense", "sparse", "sparse", "sparse"], intermediate_size=96,
              moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
              route_scale=2.0, logits_mup_width_multiplier=4.0, max_position_embeddings=512,
              rms_norm_eps=1e-5, initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              architectures=[ARCHITECTURE])
    kw.update(overrides)
    return InklingTextConfig(**kw)


class InklingMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.global_scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)) * self.global_scale


class InklingRouter(nn.Module):
    """`mlp.gate`: x [T, H] -> (routed weights [T, k], expert ids [T, k], shared weights [T, S])."""

    def __init__(self, config):
        super().__init__()
        self.num_experts, self.num_shared = config.n_routed_experts, config.n_shared_experts
        self.top_k, self.route_scale = config.num_experts_per_tok, float(config.route_scale)
        self.weight = nn.Parameter(torch.empty(self.num_experts + self.num_shared, config.hidden_size))
        self.global_scale = nn.Parameter(torch.ones(1))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts))

    def forward(self, x: torch.Tensor):
        logits = F.linear(x.float(), self.weight.float())  # routing in float32, as transformers
        routed = logits[:, :self.num_experts]
        choice = routed.sigmoid() + self.e_score_correction_bias.float()
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        log_probs = F.logsigmoid(torch.cat([routed.gather(-1, ids), logits[:, self.num_experts:]], dim=-1))
        weights = torch.exp(log_probs - torch.logsumexp(log_probs, dim=-1, keepdim=True))
        weights = (weights * self.route_scale * self.global_scale.float()).to(x.dtype)
        return weights[:, :self.top_k], ids, weights[:, self.top_k:]


class InklingSharedExperts(nn.Module):
    """S SwiGLU experts every token runs, each weighted (before down_proj) by its router weight."""

    def __init__(self, config):
        super().__init__()
        s, h, i = config.n_shared_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_proj = nn.Parameter(torch.empty(s, i, h))
        self.up_proj = nn.Parameter(torch.empty(s, i, h))
        self.down_proj = nn.Parameter(torch.empty(s, h, i))

    def forward(self, x: torch.Tensor, gammas: torch.Tensor) -> torch.Tensor:
        xs = x[None].expand(self.gate_proj.shape[0], -1, -1)
        act = F.silu(torch.bmm(xs, self.gate_proj.transpose(1, 2))) * torch.bmm(xs, self.up_proj.transpose(1, 2))
        down = torch.bmm(act * gammas.t()[:, :, None], self.down_proj.transpose(1, 2))
        return down.float().sum(dim=0).to(x.dtype)


class InklingMoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate = InklingRouter(config)
        self.experts = StackedExperts(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_experts = InklingSharedExperts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids, gammas = self.gate(x)
        out = ops.fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids, "silu")
        return out + self.shared_experts(x, gammas)


class InklingDecoderLayer(nn.Module):
    def __init__(self, config, i: int):
        super().__init__()
        self.kind = config.layer_types[i]
        if self.kind not in KINDS:
            raise ValueError(f"layer_types[{i}] is {self.kind!r}; Inkling layers are one of {KINDS}")
        mlp = config.mlp_layer_types[i]
        if mlp not in ("dense", "sparse"):
            raise ValueError(f"mlp_layer_types[{i}] is {mlp!r}; expected 'dense' or 'sparse'")
        h, k = config.hidden_size, config.conv_kernel_size
        self.self_attn = InklingAttention(config, sliding=self.kind == "hybrid_sliding")
        self.mlp = InklingMoE(config) if mlp == "sparse" else InklingMLP(config)
        self.input_layernorm = RMSNorm(h, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, eps=config.rms_norm_eps)
        self.attn_sconv = InklingShortConv(h, k)
        self.mlp_sconv = InklingShortConv(h, k)

    def conv_spec(self) -> RecurrentSpec:
        """The four conv windows, channels [k | v | attention | feed-forward], float32."""
        kv, h = self.self_attn.kv_width, self.attn_sconv.channels
        return RecurrentSpec(conv_shape=(2 * kv + 2 * h, self.attn_sconv.kernel_size - 1), state_shape=(),
                             dtype=torch.float32)

    def forward(self, h: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor, windows: torch.Tensor):
        """h [T, H] -> [T, H]; windows [S, 2 kv + 2 H, K - 1] this layer's conv pool."""
        kv, H = self.self_attn.kv_width, h.shape[1]
        k_win, v_win = windows[:, :kv], windows[:, kv:2 * kv]
        attn_win, mlp_win = windows[:, 2 * kv:2 * kv + H], windows[:, 2 * kv + H:]
        x = self.self_attn(self.input_layernorm(h), batch, kv_cache, k_win, v_win)
        h = h + self.attn_sconv(x, attn_win, batch)
        x = self.mlp(self.post_attention_layernorm(h))
        return h + self.mlp_sconv(x, mlp_win, batch)


class NormedEmbedding(nn.Embedding):
    """`embed_tokens`: an embedding followed by its RMSNorm (`embed_tokens.embed_norm`)."""

    def __init__(self, vocab: int, hidden: int, eps: float):
        super().__init__(vocab, hidden)
        self.embed_norm = RMSNorm(hidden, eps=eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_norm(super().forward(ids))


class _InklingBody(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = NormedEmbedding(config.vocab_size, config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(InklingDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class InklingModel(HybridModel):
    """Parameter names equal transformers'. Cache keys: i (KV), num_hidden_layers + i (conv windows)."""

    architecture = ARCHITECTURE

    def __init__(self, config):
        config = getattr(config, "text_config", None) or config  # a published multimodal checkpoint's text model
        super().__init__(config)
        self.model = _InklingBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mup = float(config.logits_mup_width_multiplier)
        unpadded = config.unpadded_vocab_size
        self.vocab_size = min(unpadded, config.vocab_size) if unpadded else config.vocab_size

    def tied_weights(self) -> dict[str, str]:
        return {}  # transformers: embed and unembed are separate tensors, never tied

    @torch.no_grad()
    def load_weights(self, ckpt) -> None:
        """The checkpoint's tensors (a text-only checkpoint's names, or the published multimodal
        ones: InklingCheckpointView); those transformers keeps in float32 re-read in float32."""
        ckpt = InklingCheckpointView(ckpt)
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
        n = len(self.model.layers)
        h = self.model.embed_tokens(batch.input_ids)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, batch, caches.kv[i], caches.conv[n + i])
        logits = self.compute_logits(self.model.norm(h) / self.mup, batch, self.lm_head)
        return logits[..., :self.vocab_size]


MODEL_CLASS = InklingModel
