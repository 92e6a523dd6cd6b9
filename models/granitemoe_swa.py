"""GraniteMoeSWA (Granite "swash"): attention layers alternating sliding-window and full attention,
each with a learned sink per head, followed by a top-k MoE (and, when `shared_intermediate_size >
0`, a shared SwiGLU MLP added to it).

No new kind of layer memory: `config.layer_types[i]` is "sliding_attention" (window
`sliding_window`: the token at p sees keys j with p - j < w) or "full_attention", so the manager
keeps two KV groups (GPT-OSS's arrangement) and a sliding layer holds only its window's blocks.
As transformers' GraniteMoeSWA:
- the sink rescales each head's output by sigmoid(logsumexp(scores) - sink), which equals a sink
  logit in the softmax denominator (GPT-OSS's sinks, `ops.paged_attention(sinks=...)`);
- rope per layer: `layer_rope_theta[i]` is the layer's rope base, 0 meaning no positional encoding
  (one rope table per distinct base, built once per step);
- Granite's scalars: embeddings times `embedding_multiplier`, scores times `attention_multiplier`
  (instead of head_dim ** -0.5), each residual branch times `residual_multiplier`, logits divided
  by `logits_scaling`;
- routing: softmax over the top-k router logits.
Expert tensors load from transformers' names (`experts.gate_up_proj`, `router.weight`) or Granite's
published ones (`input_linear`, `output_linear`, `router.layer`).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from hybridkv.specs import LayerSpec

from .attention import PagedAttention
from .base import HybridModel
from .decoder import HybridDecoderLayer, add_then_norm, layer_cache_specs
from .forward_batch import ForwardBatch, ModelCaches
from .granitemoehybrid import GraniteExpertNames, SharedMLP
from .moe import PerExpertView, SparseMoE
from .norms import RMSNorm
from .rotary import RotaryEmbedding

ARCHITECTURE = "GraniteMoeSWAForCausalLM"
KINDS = ("sliding_attention", "full_attention")


def tiny_config(**overrides):
    """A 4-layer GraniteMoeSWAConfig: sliding, full, sliding, full; window 24 (one and a half
    blocks of 16); rope bases 10000, none, 500000, 10000; MoE (4 experts, top-2) beside a shared
    MLP; non-trivial Granite multipliers."""
    from transformers import GraniteMoeSWAConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=32, shared_intermediate_size=48,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, sliding_window=24,
              layer_types=["sliding_attention", "full_attention"] * 2,
              layer_rope_theta=[10000.0, 0, 500000.0, 10000.0], num_local_experts=4,
              num_experts_per_tok=2, embedding_multiplier=6.0, attention_multiplier=0.15,
              residual_multiplier=0.6, logits_scaling=2.5, max_position_embeddings=512,
              rms_norm_eps=1e-5, initializer_range=0.1, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False, architectures=[ARCHITECTURE])
    kw.update(overrides)
    return GraniteMoeSWAConfig(**kw)


class GraniteMoeSWADecoderLayer(HybridDecoderLayer):
    """`self_attn` (sinks, this layer's window) after `input_layernorm`; `block_sparse_moe` plus
    `shared_mlp` after `post_attention_layernorm` (HF names); residual branches scaled."""

    mixer_norm = "input_layernorm"
    ff_norm, ff = "post_attention_layernorm", "feed_forward"

    def __init__(self, config, i: int):
        super().__init__()
        kind = config.layer_types[i]
        if kind not in KINDS:
            raise ValueError(f"layer_types[{i}] is {kind!r}; GraniteMoeSWA layers are one of {KINDS}")
        h, eps = config.hidden_size, config.rms_norm_eps
        head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
        self.residual_scale = float(config.residual_multiplier)
        self.rope_theta = float(config.layer_rope_theta[i] or 0.0)  # 0: no positional encoding
        self.self_attn = PagedAttention(
            h, config.num_attention_heads, config.num_key_value_heads, head_dim,
            qkv_bias=config.attention_bias, o_bias=config.attention_bias,
            scale=config.attention_multiplier, sinks=True,
            sliding_window=config.sliding_window if kind == "sliding_attention" else None)
        # transformers: softmax over the top-k logits == softmax, top-k, renormalise
        self.block_sparse_moe = SparseMoE(h, config.intermediate_size, config.num_local_experts,
                                          config.num_experts_per_tok, norm_topk_prob=True,
                                          act=config.hidden_act)
        self.shared_mlp = (SharedMLP(h, config.shared_intermediate_size, act=config.hidden_act)
                           if config.shared_intermediate_size > 0 else None)
        self.input_layernorm = RMSNorm(h, eps=eps)
        self.post_attention_layernorm = RMSNorm(h, eps=eps)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block_sparse_moe(x)
        return out if self.shared_mlp is None else out + self.shared_mlp(x)


class _GraniteSWABody(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GraniteMoeSWADecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


def rotary_per_base(config, thetas, head_dim: int) -> dict[float, RotaryEmbedding]:
    """One RotaryEmbedding per distinct non-zero rope base in `thetas`, each from a copy of the
    config whose rope_parameters carry that base (transformers' GraniteMoeSWAModel does the same)."""
    ropes = {}
    for theta in sorted({t for t in thetas if t}):
        c = copy.deepcopy(config)
        c.rope_parameters = {**c.rope_parameters, "rope_theta": theta}
        ropes[theta] = RotaryEmbedding(c, head_dim)
    return ropes


class GraniteMoeSWAModel(HybridModel):
    """Parameter names equal transformers'; expert tensors also load from Granite's published names."""

    architecture = ARCHITECTURE

    def __init__(self, config):
        super().__init__(config)
        if len(config.layer_rope_theta) != config.num_hidden_layers:
            raise ValueError(f"layer_rope_theta has {len(config.layer_rope_theta)} entries but "
                             f"num_hidden_layers is {config.num_hidden_layers}; give one per layer")
        self.model = _GraniteSWABody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.embedding_multiplier = float(config.embedding_multiplier)
        self.logits_scaling = float(config.logits_scaling)
        head_dim = self.model.layers[0].self_attn.head_dim
        self.rotary = rotary_per_base(config, [layer.rope_theta for layer in self.model.layers], head_dim)

    def load_weights(self, ckpt) -> None:
        super().load_weights(PerExpertView(GraniteExpertNames(ckpt)))

    def cache_specs(self) -> dict[int, LayerSpec]:
        return layer_cache_specs(self.model.layers, self.dtype)

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        ropes = {theta: rotary(batch.positions) for theta, rotary in self.rotary.items()}  # once per step
        h = self.model.embed_tokens(batch.input_ids) * self.embedding_multiplier
        pending = None
        for i, layer in enumerate(self.model.layers):
            h, pending = layer.forward_pending(h, pending, ropes.get(layer.rope_theta), batch, caches, i, None)
        h = add_then_norm(self.model.norm, h, pending)[1]
        return self.compute_logits(h, batch, self.lm_head) / self.logits_scaling


MODEL_CLASS = GraniteMoeSWAModel
