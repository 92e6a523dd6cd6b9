"""Mamba2: Mamba's pure-recurrent stack (mamba.py) with Mamba2 (SSD) mixers; no attention layer.

The mixer is Bamba's Mamba2 mixer: gated RMSNorm (gate before norm, groups of d_inner / n_groups),
`time_step_limit` clamps dt in prefill only, as in transformers.
"""
from __future__ import annotations

from .mamba import MambaModel
from .mamba2_mixer import Mamba2Mixer

ARCHITECTURE = "Mamba2ForCausalLM"


def tiny_config(**overrides):
    """A 3-layer Mamba2Config: hidden 64, 8 heads x 16 (d_inner 128), 2 groups, d_state 16,
    SSD chunks of 8 so prompts span several chunks."""
    from transformers import Mamba2Config

    kw = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_heads=8, head_dim=16,
              expand=2, n_groups=2, state_size=16, conv_kernel=4, chunk_size=8,
              layer_norm_epsilon=1e-5, initializer_range=0.1, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False, architectures=[ARCHITECTURE])
    kw.update(overrides)
    return Mamba2Config(**kw)


def mamba2_mixer(config) -> Mamba2Mixer:
    """A Mamba2Mixer from a Mamba2Config (whose validation already ties num_heads x head_dim to
    expand x hidden_size)."""
    return Mamba2Mixer(config.hidden_size, config.num_heads, config.head_dim, config.n_groups,
                       config.state_size, config.conv_kernel, config.chunk_size,
                       eps=config.layer_norm_epsilon, conv_bias=config.use_conv_bias,
                       proj_bias=config.use_bias, activation=config.hidden_act,
                       dt_limit=tuple(config.time_step_limit))


class Mamba2Model(MambaModel):
    """Parameter names equal the HF checkpoint's (backbone.layers.N.mixer.in_proj.weight, ...)."""

    architecture = ARCHITECTURE

    def __init__(self, config):
        super().__init__(config, make_mixer=mamba2_mixer)


MODEL_CLASS = Mamba2Model
