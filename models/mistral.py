"""Mistral: Llama's decoder with sliding-window attention in every layer.

With `sliding_window = w` in config.json, the token at position p attends to keys j with
p - j < w (transformers' sliding_window_overlay); each layer's AttentionSpec carries w, so the
memory manager may let go of KV blocks that have left every request's window. A config with
`sliding_window: null` is plain causal attention, i.e. Llama without biases.
"""
from __future__ import annotations

from .llama import LlamaModel

ARCHITECTURE = "MistralForCausalLM"


def tiny_config(**overrides):
    """A 2-layer GQA MistralConfig for CPU tests: window 24 (one and a half blocks of 16), so
    prompts of 53 tokens and more reach well past it; `overrides` replace any field."""
    from transformers import MistralConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=24,
              max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.1,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
              architectures=[ARCHITECTURE])
    kw.update(overrides)
    return MistralConfig(**kw)


class MistralModel(LlamaModel):
    """Parameter names equal the HF checkpoint's, as Llama's; every layer gets `sliding_window`."""

    architecture = ARCHITECTURE

    def __init__(self, config):
        super().__init__(config, sliding_window=config.sliding_window)


MODEL_CLASS = MistralModel
