"""Bamba's own checks; the shared ones are its row in test_families.py."""
import torch

from hybridkv.specs import AttentionSpec, RecurrentSpec


def test_cache_specs(family_models):
    _, ours, _ = family_models("bamba")
    specs = ours.cache_specs()
    assert isinstance(specs[1], AttentionSpec) and isinstance(specs[3], AttentionSpec)
    # conv window [conv_dim, k-1] with conv_dim = d_inner + 2 * groups * d_state; state [H, P, N]
    assert specs[0] == RecurrentSpec((128 + 2 * 2 * 16, 3), (8, 16, 16), torch.float32)
    assert specs[1] == AttentionSpec(2, 16, torch.float32)
