"""Qwen3-Next's own checks (layout, router names); the shared ones are its row in test_families.py."""
import torch

from hybridkv.models.moe import SparseMoE
from hybridkv.specs import AttentionSpec, RecurrentSpec


def test_layout_and_cache_specs(family_models):
    _, ours, _ = family_models("qwen3_next")
    kinds = [(layer.is_attention, isinstance(layer.mlp, SparseMoE)) for layer in ours.model.layers]
    # layer_types GDN/attention alternating; mlp_only_layers=[2] is dense
    assert kinds == [(False, True), (True, True), (False, False), (True, True)]
    assert ours.model.layers[1].mlp.shared_expert is not None
    specs = ours.cache_specs()
    # GDN: conv window [2 * key_dim + value_dim, k-1] = [2*32 + 64, 3], state [v_heads, dk, dv]
    assert specs[0] == RecurrentSpec((128, 3), (4, 16, 16), torch.float32)
    assert specs[1] == AttentionSpec(2, 16, torch.float32)


def test_router_weights_load_from_mlp_gate(family_models):
    _, ours, hf = family_models("qwen3_next")
    torch.testing.assert_close(ours.model.layers[0].mlp.router.weight,
                               hf.model.layers[0].mlp.gate.weight, rtol=0, atol=0)
