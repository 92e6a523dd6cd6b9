"""Mamba (v1): a stack of Mamba1 blocks and nothing else; no attention layer, no KV cache.

Block: x + mixer(norm(x)) with an RMSNorm before each mixer and `norm_f` at the end (HF names:
`backbone.embeddings`, `backbone.layers.N.norm`, `backbone.layers.N.mixer`, `backbone.norm_f`).
The mixer is Jamba's Mamba1 mixer without the dt/B/C norms. With `residual_in_fp32` the residual
stream is float32 whatever the compute dtype, as in transformers. FalconMamba (falcon_mamba.py)
is this model with weightless RMS norms on dt, B and C.
"""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.specs import LayerSpec

from .base import HybridModel
from .forward_batch import ForwardBatch, ModelCaches
from .mamba1_mixer import Mamba1Mixer
from .norms import RMSNorm
from .slot_split import split_decode_prefill

ARCHITECTURE = "MambaForCausalLM"
# No position embedding bounds the length (configs have no max_position_embeddings); a cap keeps
# the engine's length checks meaningful. LLM(max_model_len=...) lowers it.
MAX_MODEL_LEN = 1 << 20


def tiny_config(**overrides):
    """A 3-layer MambaConfig: hidden 64, d_inner 128, d_state 16, dt_rank 8, tied embeddings."""
    from transformers import MambaConfig

    kw = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, state_size=16, expand=2,
              conv_kernel=4, time_step_rank=8, layer_norm_epsilon=1e-5, initializer_range=0.1,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
              architectures=[ARCHITECTURE])
    kw.update(overrides)
    return MambaConfig(**kw)


def mamba1_mixer(config, inner_norm=nn.Identity) -> Mamba1Mixer:
    """A Mamba1Mixer from a Mamba/FalconMamba config; `inner_norm()` builds each of its dt, B and C
    norms (Jamba's weighted RMSNorms are replaced: Mamba has none, FalconMamba weightless ones)."""
    h, d_inner = config.hidden_size, config.intermediate_size
    if d_inner % h:
        raise ValueError(f"intermediate_size={d_inner} is not a multiple of hidden_size={h}; "
                         f"this Mamba mixer needs an integer expand factor")
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r}; only 'silu' Mamba mixers are supported")
    mixer = Mamba1Mixer(h, config.state_size, config.conv_kernel, d_inner // h,
                        int(config.time_step_rank), eps=config.layer_norm_epsilon,
                        conv_bias=config.use_conv_bias, proj_bias=config.use_bias)
    mixer.dt_layernorm, mixer.b_layernorm, mixer.c_layernorm = inner_norm(), inner_norm(), inner_norm()
    return mixer


class MambaBlock(nn.Module):
    """`norm` then `mixer` (any module with the Mamba mixers' signature and `cache_spec`)."""

    def __init__(self, config, mixer: nn.Module):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mixer = mixer


class _MambaBody(nn.Module):
    def __init__(self, config, make_mixer):
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MambaBlock(config, make_mixer(config))
                                    for _ in range(config.num_hidden_layers))
        self.norm_f = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)


class MambaModel(HybridModel):
    """Pure-recurrent LM: one RecurrentSpec per layer, no attention. Parameter names equal the HF
    checkpoint's. Mamba2 and FalconMamba pass their own `make_mixer(config)`."""

    architecture = ARCHITECTURE

    def __init__(self, config, make_mixer=mamba1_mixer):
        super().__init__(config)
        self.backbone = _MambaBody(config, make_mixer)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.residual_in_fp32 = bool(getattr(config, "residual_in_fp32", False))
        self.max_model_len = self.max_model_len or MAX_MODEL_LEN

    def tied_weights(self) -> dict[str, str]:
        if getattr(self.config, "tie_word_embeddings", False):
            return {"lm_head.weight": "backbone.embeddings.weight"}
        return {}

    def cache_specs(self) -> dict[int, LayerSpec]:
        return {i: layer.mixer.cache_spec(self.dtype) for i, layer in enumerate(self.backbone.layers)}

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        h = self.backbone.embeddings(batch.input_ids)
        dtype = h.dtype
        split = split_decode_prefill(batch)  # shared by every layer
        for i, layer in enumerate(self.backbone.layers):
            x = layer.mixer(layer.norm(h.to(dtype)), batch, caches.conv[i], caches.state[i], split)
            h = (h.float() if self.residual_in_fp32 else h) + x
        return self.compute_logits(self.backbone.norm_f(h).to(dtype), batch, self.lm_head)


MODEL_CLASS = MambaModel
