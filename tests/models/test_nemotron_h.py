"""Nemotron-H's own checks (blocks that keep nothing, a latent-MoE variant); the shared ones are
its row in test_families.py."""
import torch

from family_checks import BS, check_prompt_logits, load_pair, tiny_nemotron_h
from hybridkv.specs import AttentionSpec, RecurrentSpec


def test_cache_specs_skip_mlp_and_moe_blocks(family_models):
    _, ours, hf = family_models("nemotron_h")
    assert hf.config.hybrid_override_pattern == "M-*EM*"
    specs = ours.cache_specs()
    assert sorted(specs) == [0, 2, 4, 5]  # "-" (1) and "E" (3) keep nothing
    # conv window [d_inner + 2 * groups * d_state, k - 1]; state [H, P, N]
    assert specs[0] == specs[4] == RecurrentSpec((128 + 2 * 2 * 16, 3), (8, 16, 16), torch.float32)
    assert specs[2] == specs[5] == AttentionSpec(2, 16, torch.float32)
    router = ours.backbone.layers[3].mixer.gate
    assert router.e_score_correction_bias.abs().sum() > 0  # the bias takes part in routing


def test_latent_moe_variant_logits(tmp_path):
    """Attention first, latent MoE, one expert group, no renormalisation, and a dt floor
    (time_step_min) high enough to clamp in prefill."""
    path = tiny_nemotron_h("nemotron_h", tmp_path, seed=6, hybrid_override_pattern="*ME-M",
                           moe_latent_size=32, n_group=1, norm_topk_prob=False,
                           routed_scaling_factor=1.5, time_step_min=0.9)
    ours, hf = load_pair(path)
    assert ours.backbone.layers[2].mixer.fc1_latent_proj is not None
    check_prompt_logits(ours, hf, n=2 * BS + 3, seed=1)
