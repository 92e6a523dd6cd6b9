"""LFM2 (gated short conv + attention) on the pools and through the engine, against transformers'
Lfm2ForCausalLM of the same tiny checkpoint."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridkv import LLM, SamplingParams
from hybridkv.models import load_model
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.specs import AttentionSpec, RecurrentSpec
from model_harness import Harness, assert_close_rel, assert_greedy_matches_hf, hf_logits

BS = 16


def _load(path):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return load_model(path), hf


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("lfm2", tmp_path_factory.mktemp("lfm2"), seed=3)


@pytest.fixture(scope="module")
def models(ckpt):
    return _load(ckpt)


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 128, (n,), generator=g).tolist()


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
    ours, hf = models
    h = Harness(ours, block_size=BS)
    prompt = _prompt(3 * BS + 5, 0)
    logits = h.step([(h.add(prompt), len(prompt))], return_all_logits=True)
    assert_close_rel(logits, hf_logits(hf, prompt))


def test_biases_and_untied_head(tmp_path):
    # conv_bias switches on the conv, in_proj and out_proj biases together
    path = make_tiny_checkpoint("lfm2", tmp_path, seed=4, conv_bias=True, tie_word_embeddings=False,
                                layer_types=["full_attention", "conv"], num_hidden_layers=2)
    ours, hf = _load(path)
    assert ours.model.layers[1].conv.conv.bias is not None
    assert not torch.equal(ours.lm_head.weight, ours.model.embed_tokens.weight)
    h = Harness(ours, block_size=BS)
    prompt = _prompt(BS + 3, 1)
    seq = h.add(prompt)
    logits = torch.cat([h.step([(seq, 11)], return_all_logits=True),
                        h.step([(seq, len(prompt) - 11)], return_all_logits=True)])
    assert_close_rel(logits, hf_logits(hf, prompt))


def test_ragged_batch_greedy_20_tokens(models):
    ours, hf = models
    h = Harness(ours, block_size=BS)
    prompts = [_prompt(n, 10 + n) for n in (1, BS - 1, BS, BS + 1, 53)]
    seqs = [h.add(p) for p in prompts]
    h.prefill(seqs)  # all five prompts in ONE ragged batch, then 20 decode steps together
    generated = h.decode(seqs, 20)
    for p, g in zip(prompts, generated):
        assert assert_greedy_matches_hf(hf, p, g) == 0


def test_uneven_chunks_equal_one_pass(models):
    ours, _ = models
    prompt = _prompt(45, 3)
    one = Harness(ours, block_size=BS, seed=1)
    ref = one.step([(one.add(prompt), len(prompt))], return_all_logits=True)
    h = Harness(ours, block_size=BS, seed=2)
    seq, other = h.add(prompt), h.add(_prompt(9, 4))
    got = []
    # chunks of 1 and 2 tokens are shorter than the conv window (k-1 = 2): the window carries over
    for n in (5, 16, 7, 1, 2, 14):
        # each chunk resumes from the slot's conv window; another request rides along
        work = [(seq, n)] + ([(other, len(other.tokens) - other.num_computed)]
                             if other.num_computed < len(other.tokens) else [])
        got.append(h.step(work, return_all_logits=True)[:n])
        if other.num_computed == len(other.tokens):
            other.tokens.append(7)
    assert sum(t.shape[0] for t in got) == len(prompt)
    torch.testing.assert_close(torch.cat(got), ref, rtol=1e-4, atol=1e-4)


def test_state_checkpoint_at_block_boundary(models):
    ours, hf = models
    h = Harness(ours, block_size=BS)
    prompt = _prompt(2 * BS + 6, 5)
    full = h.add(prompt)
    h.prefill([full])
    want = h.decode([full], 12)[0]
    assert assert_greedy_matches_hf(hf, prompt, want) == 0

    base = h.add(prompt)
    h.step([(base, 2 * BS)])  # stop exactly at a block boundary
    ckpt = h.checkpoint(base)  # conv windows copied into a fresh slot, full blocks shared
    h.prefill([base])  # the original goes on; the checkpoint copy must not change
    h.decode([base], 3)
    fork = h.checkpoint(ckpt)  # copy-on-hit: continue from a copy of the checkpoint
    fork.tokens += prompt[2 * BS:]
    h.prefill([fork])
    assert h.decode([fork], 12)[0] == want


def test_engine_generate_matches_hf(ckpt, models):
    _, hf = models
    llm = LLM(str(ckpt), memory_budget_bytes=16 << 20)
    prompts = [_prompt(n, 20 + n) for n in (1, 7, BS, BS + 1, 37)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert len(o.outputs[0].token_ids) == 12
        assert assert_greedy_matches_hf(hf, p, list(o.outputs[0].token_ids)) == 0
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0
    assert stats["state_slots_live"] == 0
