"""Nemotron-H (Mamba2 "M", attention "*", relu2 MLP "-", MoE "E") on the pools against
transformers' NemotronHForCausalLM."""
import pytest
import torch
from safetensors.torch import load_file, save_file

from family_checks import (BS, check_engine_generate, check_prompt_logits, check_ragged_batch_greedy,
                           check_state_checkpoint_at_block_boundary,
                           check_transformers_names_load_the_same,
                           check_uneven_chunks_equal_one_pass, load_pair)
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.specs import AttentionSpec, RecurrentSpec


def _tiny(path, seed, **overrides):
    """A tiny checkpoint whose router correction biases are not all zero (init leaves them zero)."""
    path = make_tiny_checkpoint("nemotron_h", path, seed=seed, **overrides)
    tensors = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if name.endswith("e_score_correction_bias"):
            tensors[name] = torch.randn(t.shape, generator=g) * 0.3
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return _tiny(tmp_path_factory.mktemp("nemotron_h"), seed=5)


@pytest.fixture(scope="module")
def models(tiny_path):
    return load_pair(tiny_path)


def test_cache_specs_skip_mlp_and_moe_blocks(models):
    ours, hf = models
    assert hf.config.hybrid_override_pattern == "M-*EM*"
    specs = ours.cache_specs()
    assert sorted(specs) == [0, 2, 4, 5]  # "-" (1) and "E" (3) keep nothing
    # conv window [d_inner + 2 * groups * d_state, k - 1]; state [H, P, N]
    assert specs[0] == specs[4] == RecurrentSpec((128 + 2 * 2 * 16, 3), (8, 16, 16), torch.float32)
    assert specs[2] == specs[5] == AttentionSpec(2, 16, torch.float32)
    router = ours.backbone.layers[3].mixer.gate
    assert router.e_score_correction_bias.abs().sum() > 0  # the bias takes part in routing


def test_full_prompt_logits(models):
    check_prompt_logits(*models)


def test_latent_moe_variant_logits(tmp_path):
    """Attention first, latent MoE, one expert group, no renormalisation, and a dt floor
    (time_step_min) high enough to clamp in prefill."""
    path = _tiny(tmp_path, seed=6, hybrid_override_pattern="*ME-M", moe_latent_size=32, n_group=1,
                 norm_topk_prob=False, routed_scaling_factor=1.5, time_step_min=0.9)
    ours, hf = load_pair(path)
    assert ours.backbone.layers[2].mixer.fc1_latent_proj is not None
    check_prompt_logits(ours, hf, n=2 * BS + 3, seed=1)


def test_ragged_batch_greedy_20_tokens(models):
    check_ragged_batch_greedy(*models)


def test_uneven_chunks_equal_one_pass(models):
    # chunks resume from the slot's conv window and SSM state
    check_uneven_chunks_equal_one_pass(models[0], chunks=(5, 16, 7, 1, 16))


def test_state_checkpoint_at_block_boundary(models):
    check_state_checkpoint_at_block_boundary(*models)


def test_engine_generate_matches_transformers(models, tiny_path):
    check_engine_generate(tiny_path, models[1], lengths=(1, BS - 1, BS + 1, 3 * BS + 5), seed=40)


def test_transformers_in_memory_names_load_the_same(models, tiny_path, tmp_path):
    """A checkpoint holding transformers' own parameter names (stacked experts) loads identically."""
    check_transformers_names_load_the_same(
        *models, tiny_path, tmp_path, published="backbone.layers.3.mixer.experts.0.up_proj.weight",
        stacked_suffix="mixer.experts.up_proj")
