"""Jamba's own checks (layer layout); the shared ones are its row in test_families.py."""
import torch

from hybridkv.models.moe import SparseMoE
from hybridkv.specs import AttentionSpec, RecurrentSpec


def test_layout_and_cache_specs(family_models):
    _, ours, _ = family_models("jamba")
    kinds = [(layer.is_attention, isinstance(layer.feed_forward, SparseMoE))
             for layer in ours.model.layers]
    # attn_layer_period 4 / offset 1, expert_layer_period 2 / offset 1
    assert kinds == [(False, False), (True, True), (False, False), (False, True)]
    specs = ours.cache_specs()
    # Mamba1: conv window [d_inner, k-1], state [d_inner, d_state]; d_inner = 2 * 64
    assert specs[0] == RecurrentSpec((128, 3), (128, 16), torch.float32)
    assert specs[1] == AttentionSpec(2, 16, torch.float32)
