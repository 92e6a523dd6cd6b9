"""Qwen3.5 / Qwen3.5-MoE's own checks (layout, projection and router names); the shared ones are
their rows in test_families.py."""
import torch

from hybridkv.models.mlp import GatedMLP
from hybridkv.models.moe import SparseMoE
from hybridkv.specs import AttentionSpec, RecurrentSpec


def test_layout_split_projections_and_cache_specs(family_models):
    _, dense, _ = family_models("qwen3_5")
    _, moe, hf = family_models("qwen3_5_moe")
    assert [layer.is_attention for layer in dense.model.layers] == [False, True, False, True]
    assert all(type(layer.mlp) is GatedMLP for layer in dense.model.layers)
    assert all(isinstance(layer.mlp, SparseMoE) and layer.mlp.shared_expert is not None
               for layer in moe.model.layers)
    gdn = dict(dense.model.layers[0].linear_attn.named_parameters())
    assert {"in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"} <= set(gdn)
    assert not any(n.startswith(("in_proj_qkvz", "in_proj_ba")) for n in gdn)
    # GDN: conv over q, k, v = [2 * 2*16 + 4*16, 3]; state [v_heads, dk, dv]
    for model in (dense, moe):
        specs = model.cache_specs()
        assert specs[0] == specs[2] == RecurrentSpec((128, 3), (4, 16, 16), torch.float32)
        assert specs[1] == specs[3] == AttentionSpec(2, 16, torch.float32)
    torch.testing.assert_close(moe.model.layers[0].linear_attn.in_proj_z.weight,
                               hf.model.layers[0].linear_attn.in_proj_z.weight, rtol=0, atol=0)
    torch.testing.assert_close(moe.model.layers[1].mlp.router.weight,
                               hf.model.layers[1].mlp.gate.weight, rtol=0, atol=0)
