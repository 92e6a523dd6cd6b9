"""Llama on the paged pool against transformers' LlamaForCausalLM of the same tiny checkpoint."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridkv.models import load_model
from hybridkv.models.tiny import make_tiny_checkpoint
from model_harness import Harness, assert_close_rel, assert_greedy_matches_hf, hf_logits

BS = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"), seed=1,
                                attention_bias=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return load_model(path), hf


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 128, (n,), generator=g).tolist()


def test_full_prompt_logits(models):
    ours, hf = models
    h = Harness(ours, block_size=BS)
    prompt = _prompt(3 * BS + 5, 0)
    seq = h.add(prompt)
    logits = h.step([(seq, len(prompt))], return_all_logits=True)
    assert logits.shape == (len(prompt), ours.vocab_size) and logits.dtype == torch.float32
    assert_close_rel(logits, hf_logits(hf, prompt))


def test_ragged_batch_greedy_20_tokens(models):
    ours, hf = models
    h = Harness(ours, block_size=BS)
    prompts = [_prompt(n, 10 + n) for n in (1, BS - 1, BS, BS + 1, 3 * BS + 5)]
    seqs = [h.add(p) for p in prompts]
    h.prefill(seqs)  # all five prompts in ONE ragged batch
    generated = h.decode(seqs, 20)
    for p, g in zip(prompts, generated):
        assert assert_greedy_matches_hf(hf, p, g) == 0


def test_uneven_chunks_equal_one_pass(models):
    ours, _ = models
    prompt = _prompt(40, 3)
    one = Harness(ours, block_size=BS, seed=1)
    ref = one.step([(one.add(prompt), len(prompt))], return_all_logits=True)
    h = Harness(ours, block_size=BS, seed=2)
    seq, other = h.add(prompt), h.add(_prompt(9, 4))
    got, start = [], 0
    for n in (5, 16, 7, 12):
        # another request's prefill / decode rides in the same batch
        work = [(seq, n)] + ([(other, len(other.tokens) - other.num_computed)]
                             if other.num_computed < len(other.tokens) else [])
        got.append(h.step(work, return_all_logits=True)[:n])
        if other.num_computed == len(other.tokens):
            other.tokens.append(7)
        start += n
    assert start == len(prompt)
    torch.testing.assert_close(torch.cat(got), ref, rtol=1e-5, atol=1e-5)


def test_shared_prefix_blocks_continue_identically(models):
    ours, _ = models
    h = Harness(ours, block_size=BS)
    prompt = _prompt(2 * BS + 3, 5)
    full = h.add(prompt)
    h.prefill([full])
    want = h.decode([full], 8)[0]
    base = h.add(prompt)
    h.step([(base, 2 * BS)])
    fork = h.checkpoint(base)  # attention only: shares the two full blocks
    fork.tokens += prompt[2 * BS:]
    h.prefill([fork])
    assert h.decode([fork], 8)[0] == want
