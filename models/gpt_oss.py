"""GPT-OSS: attention layers alternating sliding-window and full attention, both with attention
sinks, and a mixture of experts with its own router and activation.

- Attention: q/k/v/o with biases, GQA, rope (YaRN in the published configs), and a learned sink
  logit per head that joins the softmax denominator (`self_attn.sinks`). `config.layer_types[i]`
  is "sliding_attention" (window `sliding_window`: the token at p sees keys j with p - j < w) or
  "full_attention". The memory manager keeps one block pool and table per kind, so a sliding
  layer holds only its window's blocks however long the request runs.
- Feed-forward: router = linear with bias; top-k of the logits, softmax over those k. Experts:
  gate_up with bias, clamped SwiGLU ((up + 1) * gate * sigmoid(alpha * gate), gate <= limit,
  |up| <= limit), down with bias. transformers stores `gate_up_proj [E, H, 2I]` with gate and up
  columns interleaved and `down_proj [E, I, H]`; they are loaded into the fused MoE layout
  (`[E, 2I, H]` gate rows then up rows, `[E, H, I]`) once, by GptOssCheckpointView.
The published checkpoints store experts in MXFP4 blocks; those are not read here (float weights only).
"""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.kernels import ops
from hybridkv.specs import LayerSpec

from .attention import PagedAttention
from .base import HybridModel
from .checkpoint import CheckpointError
from .decoder import HybridDecoderLayer, layer_cache_specs, rotary_for, run_layers
from .forward_batch import ForwardBatch, ModelCaches
from .norms import RMSNorm

ARCHITECTURE = "GptOssForCausalLM"


def tiny_config(**overrides):
    """A 4-layer GptOssConfig for CPU tests: sliding, full, sliding, full; window 24 (one and a
    half blocks of 16); 4 experts, top 2; YaRN rope as the published configs; swiglu_limit 0.3 so
    the clamps bite on a random checkpoint. `overrides` replace any field."""
    from transformers import GptOssConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=24,
              layer_types=["sliding_attention", "full_attention"] * 2, num_local_experts=4,
              num_experts_per_tok=2, swiglu_limit=0.3, max_position_embeddings=512, rms_norm_eps=1e-5,
              initializer_range=0.1, attention_bias=True, tie_word_embeddings=False,
              rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                               "truncate": False, "original_max_position_embeddings": 128,
                               "rope_theta": 10000.0},
              pad_token_id=0, bos_token_id=1, eos_token_id=2, architectures=[ARCHITECTURE])
    kw.update(overrides)
    return GptOssConfig(**kw)


class GptOssCheckpointView:
    """A checkpoint whose expert tensors read in the fused MoE layout: `...experts.gate_up_proj`
    [E, H, 2I] interleaved -> [E, 2I, H] gate rows then up rows, `gate_up_proj_bias` [E, 2I]
    interleaved -> gate | up, `down_proj` [E, I, H] -> [E, H, I]. Other names pass through."""

    def __init__(self, ckpt):
        self.ckpt = ckpt

    def __contains__(self, name: str) -> bool:
        return name in self.ckpt

    def get(self, name: str) -> torch.Tensor:
        t = self.ckpt.get(name)
        if name.endswith(".experts.gate_up_proj") or name.endswith(".experts.down_proj"):
            if t.dim() != 3:
                raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}; expected [experts, in, out]")
            t = t.transpose(1, 2)
        if name.endswith(".experts.gate_up_proj") or name.endswith(".experts.gate_up_proj_bias"):
            t = torch.cat([t[:, ::2], t[:, 1::2]], dim=1) if t.dim() == 3 else \
                torch.cat([t[..., ::2], t[..., 1::2]], dim=-1)
        return t.contiguous()


class GptOssExperts(nn.Module):
    """Stacked expert weights in the fused MoE layout (see GptOssCheckpointView) with biases."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))


class GptOssMoE(nn.Module):
    """hidden [T, H] -> [T, H]: the router's top-k logits, softmaxed, weight the clamped-SwiGLU experts."""

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.swiglu = (float(config.swiglu_alpha), float(config.swiglu_limit))
        self.router = nn.Linear(config.hidden_size, config.num_local_experts, bias=True)
        self.experts = GptOssExperts(config.num_local_experts, config.hidden_size, config.intermediate_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        top, ids = torch.topk(self.router(hidden), self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)
        e = self.experts
        return ops.fused_moe(hidden, e.gate_up_proj, e.down_proj, weights.to(hidden.dtype), ids,
                             gate_up_bias=e.gate_up_proj_bias, down_bias=e.down_proj_bias, swiglu=self.swiglu)


class GptOssDecoderLayer(HybridDecoderLayer):
    ff_norm = "post_attention_layernorm"
    ff = "mlp"

    def __init__(self, config, layer_idx: int):
        super().__init__()
        kind = config.layer_types[layer_idx]
        if kind not in ("sliding_attention", "full_attention"):
            raise ValueError(f"layer_types[{layer_idx}] = {kind!r}; GPT-OSS layers are "
                             f"'sliding_attention' or 'full_attention'")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        bias = config.attention_bias
        self.self_attn = PagedAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
            qkv_bias=bias, o_bias=bias, sinks=True,
            sliding_window=config.sliding_window if kind == "sliding_attention" else None)
        self.mlp = GptOssMoE(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class _GptOssBody(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GptOssDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class GptOssModel(HybridModel):
    """Parameter names equal the HF checkpoint's; expert tensors are re-laid out on load."""

    architecture = ARCHITECTURE

    def __init__(self, config):
        quant = getattr(config, "quantization_config", None)
        if quant:  # the published experts are MXFP4 blocks and scales: refuse rather than misread them
            method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", quant)
            raise CheckpointError(
                f"GptOssForCausalLM with quantization_config quant_method={method!r}: quantized experts are "
                f"not supported; save float weights first (transformers: Mxfp4Config(dequantize=True))")
        super().__init__(config)
        self.model = _GptOssBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = rotary_for(config, self.model.layers)

    def cache_specs(self) -> dict[int, LayerSpec]:
        return layer_cache_specs(self.model.layers, self.dtype)

    def load_weights(self, ckpt) -> None:
        super().load_weights(GptOssCheckpointView(ckpt))

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        h = run_layers(self.model.layers, self.model.embed_tokens(batch.input_ids), self.rotary, batch, caches)
        return self.compute_logits(self.model.norm(h), batch, self.lm_head)


MODEL_CLASS = GptOssModel
