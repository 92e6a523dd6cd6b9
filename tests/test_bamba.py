"""Bamba (Mamba2 + attention) on the pools against transformers' BambaForCausalLM."""
import pytest
import torch

from family_checks import (check_prompt_logits, check_ragged_batch_greedy,
                           check_state_checkpoint_at_block_boundary,
                           check_uneven_chunks_equal_one_pass, load_pair)
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.specs import AttentionSpec, RecurrentSpec


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return load_pair(make_tiny_checkpoint("bamba", tmp_path_factory.mktemp("bamba"), seed=2))


def test_cache_specs(models):
    ours, _ = models
    specs = ours.cache_specs()
    assert isinstance(specs[1], AttentionSpec) and isinstance(specs[3], AttentionSpec)
    # conv window [conv_dim, k-1] with conv_dim = d_inner + 2 * groups * d_state; state [H, P, N]
    assert specs[0] == RecurrentSpec((128 + 2 * 2 * 16, 3), (8, 16, 16), torch.float32)
    assert specs[1] == AttentionSpec(2, 16, torch.float32)


def test_full_prompt_logits(models):
    check_prompt_logits(*models)


def test_ragged_batch_greedy_20_tokens(models):
    check_ragged_batch_greedy(*models)


def test_uneven_chunks_equal_one_pass(models):
    # chunks resume from the slot's conv window and SSM state
    check_uneven_chunks_equal_one_pass(models[0], chunks=(5, 16, 7, 1, 16))


def test_state_checkpoint_at_block_boundary(models):
    check_state_checkpoint_at_block_boundary(*models)
