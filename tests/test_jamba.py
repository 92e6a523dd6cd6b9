"""Jamba (Mamba1 + attention + MoE) on the pools against transformers' JambaForCausalLM."""
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
    return load_pair(make_tiny_checkpoint("jamba", tmp_path_factory.mktemp("jamba"), seed=3))


def test_layout_and_cache_specs(models):
    ours, _ = models
    kinds = [(layer.is_attention, isinstance(layer.feed_forward, SparseMoE))
             for layer in ours.model.layers]
    # attn_layer_period 4 / offset 1, expert_layer_period 2 / offset 1
    assert kinds == [(False, False), (True, True), (False, False), (False, True)]
    specs = ours.cache_specs()
    # Mamba1: conv window [d_inner, k-1], state [d_inner, d_state]; d_inner = 2 * 64
    assert specs[0] == RecurrentSpec((128, 3), (128, 16), torch.float32)
    assert specs[1] == AttentionSpec(2, 16, torch.float32)


def test_full_prompt_logits(models):
    check_prompt_logits(*models)


def test_ragged_batch_greedy_20_tokens(models):
    check_ragged_batch_greedy(*models)


def test_uneven_chunks_equal_one_pass(models):
    check_uneven_chunks_equal_one_pass(models[0], chunks=(5, 16, 7, 1, 16))


def test_state_checkpoint_at_block_boundary(models):
    check_state_checkpoint_at_block_boundary(*models)
