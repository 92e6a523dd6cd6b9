"""FalconMamba: Mamba (mamba.py) whose mixer RMS-normalises dt, B and C without a weight.

The three norms use `mixer_rms_eps` and carry no parameter (transformers keeps a non-persistent
all-ones buffer, never in a checkpoint), so they add nothing to load.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from .mamba import MambaModel, mamba1_mixer

ARCHITECTURE = "FalconMambaForCausalLM"


def tiny_config(**overrides):
    """A 3-layer FalconMambaConfig: hidden 64, d_inner 128, d_state 16, dt_rank 8, tied embeddings."""
    from transformers import FalconMambaConfig

    kw = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, state_size=16, expand=2,
              conv_kernel=4, time_step_rank=8, layer_norm_epsilon=1e-5, mixer_rms_eps=1e-6,
              initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=True, architectures=[ARCHITECTURE])
    kw.update(overrides)
    return FalconMambaConfig(**kw)


class WeightlessRMSNorm(nn.Module):
    """x [..., d] -> x / rms(x), computed in float32 and cast back."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class FalconMambaModel(MambaModel):
    architecture = ARCHITECTURE

    def __init__(self, config):
        norm = partial(WeightlessRMSNorm, config.mixer_rms_eps)
        super().__init__(config, make_mixer=lambda c: mamba1_mixer(c, inner_norm=norm))


MODEL_CLASS = FalconMambaModel
