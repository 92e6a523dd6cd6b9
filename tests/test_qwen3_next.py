"""Qwen3-Next (gated delta net + gated attention + MoE with a shared expert) against transformers."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridkv.models import load_model
from hybridkv.models.moe import SparseMoE
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.specs import AttentionSpec, RecurrentSpec
from model_harness import Harness, assert_close_rel, assert_greedy_matches_hf, hf_logits

BS = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = make_tiny_checkpoint("qwen3_next", tmp_path_factory.mktemp("qwen3_next"), seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return load_model(path), hf


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 128, (n,), generator=g).tolist()


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
    ours, hf = models
    h = Harness(ours, block_size=BS)
    prompt = _prompt(3 * BS + 5, 0)
    logits = h.step([(h.add(prompt), len(prompt))], return_all_logits=True)
    assert_close_rel(logits, hf_logits(hf, prompt))


def test_ragged_batch_greedy_20_tokens(models):
    ours, hf = models
    h = Harness(ours, block_size=BS)
    prompts = [_prompt(n, 10 + n) for n in (1, BS - 1, BS, BS + 1, 3 * BS + 5)]
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
    for n in (5, 16, 7, 1, 16):
        # chunks (and a one-token chunk, which takes the decode path) resume from the slot;
        # another request rides along, first prefilling, then decoding
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
    ckpt = h.checkpoint(base)  # state copied into a fresh slot, full blocks shared
    h.prefill([base])  # the original goes on; the checkpoint copy must not change
    h.decode([base], 3)
    fork = h.checkpoint(ckpt)  # copy-on-hit: continue from a copy of the checkpoint
    fork.tokens += prompt[2 * BS:]
    h.prefill([fork])
    assert h.decode([fork], 12)[0] == want
