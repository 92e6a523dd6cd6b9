"""GLM-5-Next (transformers' Glm5NextForConditionalGeneration, its text model; GLM-5.3-Flash).

Per `config.layer_types[i]`: "linear_attention" is Kimi delta attention (models/kda_mixer.py: one
depthwise conv window over [q | k | v] and a per-channel delta-rule state in a state slot) with
GLM's bounded forget gate (`linear_lower_bound * sigmoid(exp(A_log) * g)`); "indexed_attention" is
DSA (models/glm5_next_attention.py: latent KV pages under key i, the indexer's own pages under
key `num_hidden_layers + i`). Feed-forward per `mlp_layer_types`: a clamped SwiGLU ("dense") or
DeepSeek-V3 routing over clamped-SwiGLU experts plus shared experts ("sparse"). The residual is
`hc_mult` streams joined by manifold-constrained hyper-connections (a Sinkhorn-balanced mix per
block), averaged before the final norm. Published checkpoints (`hc_attn_fn`, per-expert weights,
split q/k/v convs, forget-gate weights on `self_attn`, `model.language_model.` or `model.` prefix)
load as saved; the vision tower is not loaded. Numbers follow transformers in float32; in bfloat16
transformers keeps the KDA conv in float32 and the engine does not, so bf16 runs are close, not
identical. Tensor parallelism is refused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kernels import ops
from hybridkv.specs import LayerSpec

from .base import HybridModel
from .forward_batch import ForwardBatch, ModelCaches
from .glm5_next_attention import DsaAttention
from .glm5_next_names import Glm5NextNames
from .kda_mixer import KimiDeltaAttentionMixer
from .moe import PerExpertView, StackedExperts
from .nemotron_h import NemotronHRouter
from .norms import RMSNorm
from .slot_split import split_decode_prefill

ARCHITECTURE = "Glm5NextForConditionalGeneration"


def tiny_config(**overrides):
    """A 5-layer Glm5NextConfig (a 1-block vision tower beside it): KDA, DSA, DSA sharing the
    previous selection, KDA, DSA; layer 0 dense, then MoE (4 experts in 2 groups, top 2 of 1 group,
    a shared expert); pools of 4 tokens, 2 pools per query (index_topk 8) of 8 indexer heads; 2
    hyper-connection streams. Text overrides go to text_config."""
    from transformers import Glm5NextConfig

    text = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4,
                layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
                             "indexed_attention"],
                indexer_types=["full", "full", "shared", "full", "full"],
                mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"], n_routed_experts=4,
                num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.0, n_shared_experts=1,
                kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=0, qk_nope_head_dim=16, v_head_dim=16,
                index_topk=8, index_head_dim=16, index_n_heads=8, index_kpool=4, linear_head_dim=16,
                linear_num_heads=2, linear_conv_kernel_dim=4, hc_mult=2, swiglu_limit=3.0,
                max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.1, pad_token_id=0,
                bos_token_id=1, eos_token_id=2)
    text.update(overrides)
    vision = dict(depth=1, hidden_size=32, num_heads=2, out_hidden_size=64, intermediate_size=32,
                  projection_intermediate_size=32)
    return Glm5NextConfig(text_config=text, vision_config=vision, architectures=[ARCHITECTURE],
                          bos_token_id=1, eos_token_id=2, pad_token_id=0)


def text_model_config(config):
    """The text model's config: the multimodal config nests it (a flat text config is itself)."""
    return getattr(config, "text_config", None) or config


def check_config(c) -> None:
    """Refuse what the engine would run otherwise than transformers, naming the field."""
    for name, values, allowed in (("layer_types", c.layer_types, ("linear_attention", "indexed_attention")),
                                  ("mlp_layer_types", c.mlp_layer_types, ("dense", "sparse")),
                                  ("indexer_types", c.indexer_types, ("full", "shared"))):
        for i, t in enumerate(values[:c.num_hidden_layers]):
            if t not in allowed:
                raise ValueError(f"{name}[{i}] is {t!r}; GLM-5-Next layers are one of {allowed}")
    for i, t in enumerate(c.layer_types):
        if t == "indexed_attention" and c.indexer_types[i] == "shared" and (
                i == 0 or c.layer_types[i - 1] != "indexed_attention" or c.indexer_types[i - 1] != "full"):
            raise ValueError(f"indexer_types[{i}] is 'shared' but layer {i - 1} is not an indexed_attention "
                             f"layer with its own indexer ('full'); transformers has no selection to share there")
    if c.qk_rope_head_dim != 0 or c.q_lora_rank is None:
        raise ValueError(f"qk_rope_head_dim={c.qk_rope_head_dim}, q_lora_rank={c.q_lora_rank}: GLM-5-Next's "
                         f"DSA layers are rotary-free with a low-rank query (0 and an int)")
    if c.index_kpool > 1 and not c.index_kpool_always_select_tail:
        raise ValueError("index_kpool_always_select_tail=False with index_kpool > 1: a query before its first "
                         "complete pool would attend to nothing (transformers then attends everywhere, the "
                         "future too); only True is supported")
    if c.hidden_act != "silu":
        raise ValueError(f"hidden_act={c.hidden_act!r}; GLM-5-Next's KDA conv and MLPs run silu")


class HyperConnection(nn.Module):
    """`attn_hc` / `ffn_hc`: streams [T, N, H] -> (post [T, N], comb [T, N, N] float32, the block's
    input [T, H]), transformers' Glm5NextTextHyperConnection step for step."""

    def __init__(self, config):
        super().__init__()
        n = self.hc_mult = config.hc_mult
        self.iters, self.hc_eps, self.norm_eps = config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * config.hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, streams: torch.Tensor):
        n = self.hc_mult
        flat = streams.reshape(streams.shape[0], -1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        pre_w, post_w, comb_w = F.linear(flat, self.fn.float()).split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        return post, comb, (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def join(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The block's output [T, H] expanded by post and added to the comb-mixed streams [T, N, H]."""
    dtype = out.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), residual)


def clamped_glu(limit: float):
    """(gate, up) -> silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    return lambda gate, up: F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


class ClampedMLP(nn.Module):
    """gate_proj / up_proj / down_proj with transformers' swiglu_limit clamps."""

    def __init__(self, hidden: int, inner: int, limit: float):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.glu = clamped_glu(limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.glu(self.gate_proj(x), self.up_proj(x)))


class Glm5NextMoE(nn.Module):
    """`mlp` on sparse layers: `gate` (DeepSeek-V3 routing), stacked `experts`, `shared_experts`."""

    def __init__(self, c):
        super().__init__()
        self.gate = NemotronHRouter(c)
        self.experts = StackedExperts(c.n_routed_experts, c.hidden_size, c.moe_intermediate_size)
        self.shared_experts = ClampedMLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts, c.swiglu_limit)
        self.glu = clamped_glu(c.swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = ops.fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights.to(x.dtype), ids,
                            glu=self.glu)
        return out + self.shared_experts(x)


class Glm5ForgetGate(nn.Module):
    """`self_attn.forget_gate`: x [T, hidden] -> log-decay [T, H, K] float32."""

    def __init__(self, c):
        super().__init__()
        self.num_heads, self.head_dim, self.lower_bound = c.linear_num_heads, c.linear_head_dim, c.linear_lower_bound
        self.f_a_proj = nn.Linear(c.hidden_size, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, self.num_heads * self.head_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(self.num_heads * self.head_dim))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).view(x.shape[0], self.num_heads, -1)
        rate = self.A_log.float().exp().view(1, self.num_heads, 1)
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * g)
        return -rate * torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))


class Glm5NextDecoderLayer(nn.Module):
    def __init__(self, c, i: int):
        super().__init__()
        self.is_attention = c.layer_types[i] == "indexed_attention"
        if self.is_attention:
            self.self_attn = DsaAttention(c, shared=c.indexer_types[i] == "shared")
        else:
            self.self_attn = KimiDeltaAttentionMixer(c.hidden_size, c.linear_num_heads, c.linear_head_dim,
                                                     c.linear_conv_kernel_dim, c.rms_norm_eps, c.hidden_act)
            self.self_attn.forget_gate = Glm5ForgetGate(c)
        self.mlp = (Glm5NextMoE(c) if c.mlp_layer_types[i] == "sparse"
                    else ClampedMLP(c.hidden_size, c.intermediate_size, c.swiglu_limit))
        self.input_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.attn_hc = HyperConnection(c)
        self.ffn_hc = HyperConnection(c)

    def forward(self, streams, batch, caches: ModelCaches, i: int, n: int, split, selected):
        """streams [T, N, H] -> (streams, this layer's selection or the one it was handed)."""
        post, comb, x = self.attn_hc(streams)
        x = self.input_layernorm(x)
        if self.is_attention:
            x, selected = self.self_attn(x, batch, caches.kv[i], caches.kv.get(n + i), selected)
        else:
            x = self.self_attn(x, batch, caches.conv[i], caches.state[i], split)
        streams = join(post, comb, x, streams)
        post, comb, x = self.ffn_hc(streams)
        return join(post, comb, self.mlp(self.post_attention_layernorm(x)), streams), selected


class Glm5NextBody(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Glm5NextDecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)


class Glm5NextModel(HybridModel):
    """Parameter names: transformers' text model's in-memory ones under `model.`. Cache keys: i
    (latent KV or the KDA slot), num_hidden_layers + i (a full DSA layer's indexer pages)."""

    architecture = ARCHITECTURE

    def __init__(self, config):
        c = text_model_config(config)
        check_config(c)
        super().__init__(c)
        self.hc_mult = c.hc_mult
        self.model = Glm5NextBody(c)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def tied_weights(self) -> dict[str, str]:
        return {}  # Glm5NextForConditionalGeneration never ties (tie_word_embeddings False)

    def load_weights(self, ckpt) -> None:
        super().load_weights(PerExpertView(Glm5NextNames(ckpt)))

    def cache_specs(self) -> dict[int, LayerSpec]:
        n, dtype = len(self.model.layers), self.dtype
        specs: dict[int, LayerSpec] = {}
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            if layer.is_attention:
                specs[i] = attn.spec(dtype)
                if attn.indexer is not None:
                    specs[n + i] = attn.indexer.spec(dtype)
            else:
                specs[i] = attn.cache_spec(dtype)
        return specs

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        body, n = self.model, len(self.model.layers)
        h = body.embed_tokens(batch.input_ids)
        streams = h.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        split, selected = split_decode_prefill(batch), None
        for i, layer in enumerate(body.layers):
            streams, selected = layer(streams, batch, caches, i, n, split, selected)
        return self.compute_logits(body.norm(streams.mean(dim=1)), batch, self.lm_head)


MODEL_CLASS = Glm5NextModel
