"""LFM2 (gated short conv + attention) on the pools and through the engine, against transformers'
Lfm2ForCausalLM of the same tiny checkpoint."""
import pytest
import torch

from family_checks import (BS, check_engine_generate, check_prompt_logits, check_ragged_batch_greedy,
                           check_state_checkpoint_at_block_boundary,
                           check_uneven_chunks_equal_one_pass, load_pair, prompt)
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.specs import AttentionSpec, RecurrentSpec
from model_harness import Harness, assert_close_rel, hf_logits


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("lfm2", tmp_path_factory.mktemp("lfm2"), seed=3)


@pytest.fixture(scope="module")
def models(ckpt):
    return load_pair(ckpt)


def test_cache_specs(models):
    ours, hf = models
    specs = ours.cache_specs()
    # conv layers keep only the window of the last k-1 gated inputs: no SSM state
    assert specs[0] == specs[1] == specs[3] == RecurrentSpec((64, 2), (), torch.float32)
    assert specs[2] == AttentionSpec(2, 16, torch.float32)
    # the feed-forward width follows transformers' block_auto_adjust_ff_dim rounding
    assert ours.model.layers[0].feed_forward.gate_proj.weight.shape == \
        hf.model.layers[0].feed_forward.w1.weight.shape == (128, 64)


def test_full_prompt_logits(models):
    check_prompt_logits(*models)


def test_biases_and_untied_head(tmp_path):
    # conv_bias switches on the conv, in_proj and out_proj biases together
    path = make_tiny_checkpoint("lfm2", tmp_path, seed=4, conv_bias=True, tie_word_embeddings=False,
                                layer_types=["full_attention", "conv"], num_hidden_layers=2)
    ours, hf = load_pair(path)
    assert ours.model.layers[1].conv.conv.bias is not None
    assert not torch.equal(ours.lm_head.weight, ours.model.embed_tokens.weight)
    h = Harness(ours, block_size=BS)
    tokens = prompt(BS + 3, 1)
    seq = h.add(tokens)
    logits = torch.cat([h.step([(seq, 11)], return_all_logits=True),
                        h.step([(seq, len(tokens) - 11)], return_all_logits=True)])
    assert_close_rel(logits, hf_logits(hf, tokens))


def test_ragged_batch_greedy_20_tokens(models):
    check_ragged_batch_greedy(*models)


def test_uneven_chunks_equal_one_pass(models):
    # chunks of 1 and 2 tokens are shorter than the conv window (k-1 = 2): the window carries over
    check_uneven_chunks_equal_one_pass(models[0], chunks=(5, 16, 7, 1, 2, 14))


def test_state_checkpoint_at_block_boundary(models):
    # here the "state" is the conv windows alone
    check_state_checkpoint_at_block_boundary(*models)


def test_engine_generate_matches_hf(ckpt, models):
    check_engine_generate(ckpt, models[1], lengths=(1, 7, BS, BS + 1, 37), seed=20)
