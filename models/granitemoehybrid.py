"""GraniteMoeHybrid (Granite 4.0-H): Mamba2 and attention layers (`config.layer_types`), each
followed by a shared SwiGLU MLP plus, when `num_local_experts > 0`, a top-k MoE.

Granite's scalars, as transformers applies them: embeddings times `embedding_multiplier`,
attention scores times `attention_multiplier` (instead of head_dim ** -0.5), each residual branch
times `residual_multiplier`, logits divided by `logits_scaling`. Attention rotates with rope when
`position_embedding_type == "rope"` and has no positional encoding otherwise (Mamba carries order).
"""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.specs import LayerSpec

from .attention import PagedAttention
from .base import HybridModel
from .decoder import HybridDecoderLayer, layer_cache_specs, rotary_for, run_layers
from .forward_batch import ForwardBatch, ModelCaches
from .mamba2_mixer import Mamba2Mixer
from .moe import PerExpertView, SparseMoE
from .norms import RMSNorm
from .row_parallel import RowParallel

ARCHITECTURE = "GraniteMoeHybridForCausalLM"
_MAMBA = ("linear_attention", "mamba")  # transformers' name and the published checkpoints' name
_ATTENTION = ("full_attention", "attention")


def tiny_config(**overrides):
    """A 4-layer GraniteMoeHybridConfig: Mamba2, attention, Mamba2, attention; rope; MoE (4 experts,
    top-2) beside the shared MLP; non-trivial multipliers; Mamba2 chunk size 8."""
    from transformers import GraniteMoeHybridConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=32, shared_intermediate_size=48,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              layer_types=["mamba", "attention", "mamba", "attention"], num_local_experts=4,
              num_experts_per_tok=2, position_embedding_type="rope", embedding_multiplier=6.0,
              attention_multiplier=0.15, residual_multiplier=0.6, logits_scaling=2.5,
              mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16,
              mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, max_position_embeddings=512,
              rms_norm_eps=1e-5, initializer_range=0.1, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False, architectures=[ARCHITECTURE])
    kw.update(overrides)
    return GraniteMoeHybridConfig(**kw)


def _is_mamba(config, i: int) -> bool:
    kind = config.layer_types[i]
    if kind not in _MAMBA + _ATTENTION:
        raise ValueError(f"layer_types[{i}] is {kind!r}; GraniteMoeHybrid layers are one of "
                         f"{_MAMBA + _ATTENTION}")
    return kind in _MAMBA


class SharedMLP(RowParallel, nn.Module):
    """x [T, hidden] -> [T, hidden]: output_linear(act(a) * b) with [a | b] = input_linear(x) (HF names)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu"):
        super().__init__()
        from transformers.activations import ACT2FN

        self.input_linear = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.output_linear = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.input_linear(x).chunk(2, dim=-1)
        return self.rank_sum(self.output_linear(self.act_fn(a) * b))


class GraniteMoeHybridDecoderLayer(HybridDecoderLayer):
    """Pre-norm block: `mamba` or `self_attn` after `input_layernorm`; then `shared_mlp`
    (+ `block_sparse_moe`) after `post_attention_layernorm` (HF names); both residual branches
    times `residual_multiplier`."""

    mixer_norm, recurrent = "input_layernorm", "mamba"  # the checkpoint's module names
    ff_norm, ff = "post_attention_layernorm", "feed_forward"

    def __init__(self, config, i: int):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.residual_scale = float(config.residual_multiplier)
        if _is_mamba(config, i):
            self.mamba = Mamba2Mixer(h, config.mamba_n_heads, config.mamba_d_head,
                                     config.mamba_n_groups, config.mamba_d_state, config.mamba_d_conv,
                                     config.mamba_chunk_size, eps=eps,
                                     conv_bias=config.mamba_conv_bias,
                                     proj_bias=config.mamba_proj_bias, activation=config.hidden_act,
                                     dt_limit=config.time_step_limit)
        else:
            head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
            self.self_attn = PagedAttention(h, config.num_attention_heads, config.num_key_value_heads,
                                            head_dim, qkv_bias=config.attention_bias,
                                            o_bias=config.attention_bias,
                                            scale=config.attention_multiplier)
        self.shared_mlp = SharedMLP(h, config.shared_intermediate_size, act=config.hidden_act)
        self.block_sparse_moe = None
        if config.num_local_experts > 0:
            # transformers: softmax over the top-k logits == softmax, top-k, renormalise
            self.block_sparse_moe = SparseMoE(h, config.intermediate_size, config.num_local_experts,
                                              config.num_experts_per_tok, norm_topk_prob=True,
                                              act=config.hidden_act)
        self.input_layernorm = RMSNorm(h, eps=eps)
        self.post_attention_layernorm = RMSNorm(h, eps=eps)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.shared_mlp(x)
        if self.block_sparse_moe is not None:
            out = self.block_sparse_moe(x) + out
        return out


class _GraniteBody(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GraniteMoeHybridDecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class GraniteExpertNames:
    """The checkpoint with transformers' fused-expert names (`experts.gate_up_proj`,
    `experts.down_proj`, `router.weight`) answered from Granite's published ones
    (`input_linear.weight` [E, 2I, H], `output_linear.weight` [E, H, I], `router.layer.weight`)."""

    _ALIASES = ((".block_sparse_moe.experts.gate_up_proj", ".block_sparse_moe.input_linear.weight"),
                (".block_sparse_moe.experts.down_proj", ".block_sparse_moe.output_linear.weight"),
                (".block_sparse_moe.router.weight", ".block_sparse_moe.router.layer.weight"))

    def __init__(self, ckpt):
        self.ckpt = ckpt

    def _source(self, name: str) -> str:
        if name in self.ckpt:
            return name
        for new, old in self._ALIASES:
            if name.endswith(new) and name[:-len(new)] + old in self.ckpt:
                return name[:-len(new)] + old
        return name

    def __contains__(self, name: str) -> bool:
        return self._source(name) in self.ckpt

    def get(self, name: str) -> torch.Tensor:
        return self.ckpt.get(self._source(name))


class GraniteMoeHybridModel(HybridModel):
    """Parameter names equal transformers' (model.layers.N.mamba.in_proj.weight, ...); the MoE's
    per-expert weights are sliced from the checkpoint's stacked expert tensors."""

    architecture = ARCHITECTURE

    def __init__(self, config):
        super().__init__(config)
        self.model = _GraniteBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.embedding_multiplier = float(config.embedding_multiplier)
        self.logits_scaling = float(config.logits_scaling)
        use_rope = config.position_embedding_type == "rope"
        self.rotary = rotary_for(config, self.model.layers) if use_rope else None

    def load_weights(self, ckpt) -> None:
        """Granite's stacked `input_linear` / `output_linear` expert tensors, or transformers' fused ones."""
        super().load_weights(PerExpertView(GraniteExpertNames(ckpt)))

    def cache_specs(self) -> dict[int, LayerSpec]:
        return layer_cache_specs(self.model.layers, self.dtype)

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        h = self.model.embed_tokens(batch.input_ids) * self.embedding_multiplier
        h = run_layers(self.model.layers, h, self.rotary, batch, caches)
        return self.compute_logits(self.model.norm(h), batch, self.lm_head) / self.logits_scaling


MODEL_CLASS = GraniteMoeHybridModel
