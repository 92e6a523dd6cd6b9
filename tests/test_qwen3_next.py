"""Qwen3-Next (gated delta net + gated attention + MoE with a shared expert) against transformers."""
import pytest
import torch

from family_checks import (check_prompt_logits, check_ragged_batch_greedy,
                           check_state_checkpoint_at_block_boundary,
                           check_uneven_chunks_equal_one_pass, load_pair)
from hybridkv.models.moe import SparseMoE
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.specs import AttentionSpec, RecurrentSpec


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return load_pair(make_tiny_checkpoint("qwen3_next", tmp_path_factory.mktemp("qwen3_next"), seed=3))


def test_layout_and_cache_specs(models):
    ours, _ = models
    kinds = [(layer.is_attention, isinstance(layer.mlp, SparseMoE)) for layer in ours.model.layers]
    # layer_types GDN/attention alternating; mlp_only_layers=[2] is dense
    assert kinds == [(False, True), (True, True), (False, False), (True, True)]
    assert ours.model.layers[1].mlp.shared_expert is not None
    specs = ours.cache_specs()
    # GDN: conv window [2 * key_dim + value_dim, k-1] = [2*32 + 64, 3], state [v_heads, dk, dv]
    assert specs[0] == RecurrentSpec((128, 3), (4, 16, 16), torch.float32)
    assert specs[1] == AttentionSpec(2, 16, torch.float32)


def test_router_weights_load_from_mlp_gate(models):
    ours, hf = models
    torch.testing.assert_close(ours.model.layers[0].mlp.router.weight,
                               hf.model.layers[0].mlp.gate.weight, rtol=0, atol=0)


def test_full_prompt_logits(models):
    check_prompt_logits(*models)


def test_ragged_batch_greedy_20_tokens(models):
    check_ragged_batch_greedy(*models)


def test_uneven_chunks_equal_one_pass(models):
    check_uneven_chunks_equal_one_pass(models[0], chunks=(5, 16, 7, 1, 16))


def test_state_checkpoint_at_block_boundary(models):
    check_state_checkpoint_at_block_boundary(*models)
