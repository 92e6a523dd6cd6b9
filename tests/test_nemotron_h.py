"""Nemotron-H (Mamba2 "M", attention "*", relu2 MLP "-", MoE "E") on the pools against
transformers' NemotronHForCausalLM."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hybridkv import LLM, SamplingParams
from hybridkv.models import load_model
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.specs import AttentionSpec, RecurrentSpec
from model_harness import Harness, assert_close_rel, assert_greedy_matches_hf, hf_logits

BS = 16


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
    hf = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    return load_model(tiny_path), hf


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 128, (n,), generator=g).tolist()


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
    ours, hf = models
    h = Harness(ours, block_size=BS)
    prompt = _prompt(3 * BS + 5, 0)
    logits = h.step([(h.add(prompt), len(prompt))], return_all_logits=True)
    assert_close_rel(logits, hf_logits(hf, prompt))


def test_latent_moe_variant_logits(tmp_path):
    """Attention first, latent MoE, one expert group, no renormalisation, and a dt floor
    (time_step_min) high enough to clamp in prefill."""
    path = _tiny(tmp_path, seed=6, hybrid_override_pattern="*ME-M", moe_latent_size=32, n_group=1,
                 norm_topk_prob=False, routed_scaling_factor=1.5, time_step_min=0.9)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_model(path)
    assert ours.backbone.layers[2].mixer.fc1_latent_proj is not None
    h = Harness(ours, block_size=BS)
    prompt = _prompt(2 * BS + 3, 1)
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
        # chunks resume from the slot's conv window and SSM state; another request rides along
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


def test_engine_generate_matches_transformers(models, tiny_path):
    _, hf = models
    prompts = [_prompt(n, 40 + n) for n in (1, BS - 1, BS + 1, 3 * BS + 5)]
    llm = LLM(str(tiny_path), memory_budget_bytes=16 << 20)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert len(o.outputs[0].token_ids) == 12
        assert assert_greedy_matches_hf(hf, p, o.outputs[0].token_ids) == 0
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["state_slots_live"] == 0, stats


def test_transformers_in_memory_names_load_the_same(models, tiny_path, tmp_path):
    """A checkpoint holding transformers' own parameter names (stacked experts) loads identically."""
    ours, hf = models
    assert "backbone.layers.3.mixer.experts.0.up_proj.weight" in load_file(str(tiny_path / "model.safetensors"))
    shutil.copytree(tiny_path, tmp_path / "ckpt")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mixer.experts.up_proj") for k in state)
    save_file(state, str(tmp_path / "ckpt" / "model.safetensors"), metadata={"format": "pt"})
    again = load_model(tmp_path / "ckpt")
    prompt = _prompt(BS + 3, 9)
    a, b = Harness(ours), Harness(again)
    torch.testing.assert_close(a.step([(a.add(prompt), len(prompt))], return_all_logits=True),
                               b.step([(b.add(prompt), len(prompt))], return_all_logits=True),
                               rtol=0, atol=0)
