"""GraniteMoeHybrid (Mamba2 + attention, shared MLP + MoE, Granite multipliers) on the pools
against transformers' GraniteMoeHybridForCausalLM."""
import pytest
import torch

from family_checks import (BS, check_engine_generate, check_prompt_logits, check_ragged_batch_greedy,
                           check_state_checkpoint_at_block_boundary,
                           check_transformers_names_load_the_same,
                           check_uneven_chunks_equal_one_pass, load_pair)
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.specs import AttentionSpec, RecurrentSpec


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_checkpoint("granitemoehybrid", tmp_path_factory.mktemp("granite"), seed=3)


@pytest.fixture(scope="module")
def models(tiny_path):
    return load_pair(tiny_path)


def test_cache_specs(models):
    ours, _ = models
    specs = ours.cache_specs()
    assert sorted(specs) == [0, 1, 2, 3]
    # conv window [d_inner + 2 * groups * d_state, k - 1]; state [H, P, N]
    assert specs[0] == specs[2] == RecurrentSpec((128 + 2 * 2 * 16, 3), (8, 16, 16), torch.float32)
    assert specs[1] == specs[3] == AttentionSpec(2, 16, torch.float32)


def test_full_prompt_logits(models):
    check_prompt_logits(*models)


def test_dense_nope_tied_variant_logits(tmp_path):
    """No MoE (shared MLP only), no rope, tied embeddings, other multipliers, mamba first and last."""
    path = make_tiny_checkpoint("granitemoehybrid", tmp_path, seed=4, num_local_experts=0,
                                position_embedding_type=None, tie_word_embeddings=True,
                                layer_types=["mamba", "attention", "mamba"], num_hidden_layers=3,
                                embedding_multiplier=2.0, attention_multiplier=0.3,
                                residual_multiplier=0.9, logits_scaling=0.7)
    ours, hf = load_pair(path)
    assert ours.rotary is None and all(layer.block_sparse_moe is None for layer in ours.model.layers)
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
        *models, tiny_path, tmp_path, published="model.layers.0.block_sparse_moe.input_linear.weight",
        stacked_suffix="block_sparse_moe.experts.gate_up_proj")
