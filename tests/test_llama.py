"""Llama on the paged pool against transformers' LlamaForCausalLM of the same tiny checkpoint."""
import pytest
import torch

from family_checks import (BS, check_prompt_logits, check_ragged_batch_greedy,
                           check_uneven_chunks_equal_one_pass, load_pair, prompt)
from hybridkv.models.tiny import make_tiny_checkpoint
from model_harness import Harness


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return load_pair(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"), seed=1,
                                          attention_bias=True))


def test_full_prompt_logits(models):
    logits = check_prompt_logits(*models)
    assert logits.shape == (3 * BS + 5, models[0].vocab_size) and logits.dtype == torch.float32


def test_ragged_batch_greedy_20_tokens(models):
    check_ragged_batch_greedy(*models)


def test_uneven_chunks_equal_one_pass(models):
    # attention only: each chunk reads the KV blocks written so far
    check_uneven_chunks_equal_one_pass(models[0], chunks=(5, 16, 7, 12), tol=1e-5)


def test_shared_prefix_blocks_continue_identically(models):
    ours, _ = models
    h = Harness(ours, block_size=BS)
    tokens = prompt(2 * BS + 3, 5)
    full = h.add(tokens)
    h.prefill([full])
    want = h.decode([full], 8)[0]
    base = h.add(tokens)
    h.step([(base, 2 * BS)])
    fork = h.checkpoint(base)  # attention only: shares the two full blocks
    fork.tokens += tokens[2 * BS:]
    h.prefill([fork])
    assert h.decode([fork], 8)[0] == want
