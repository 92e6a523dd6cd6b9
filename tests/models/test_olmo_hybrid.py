"""OLMo-Hybrid's own checks: the planner equals the model's specs, a NoPE checkpoint (as published:
no rope_theta) matches transformers, beta up to 2 and the whole-projection q/k norms matter,
and configs it would run wrongly are refused. The shared checks (the engine under memory
pressure, a prefix hit and migration mid-decode among them) are its row in test_families.py."""
import json

import pytest
import torch

from family_checks import BS, check_prompt_logits, check_ragged_batch_greedy, load_pair, prompt
from hybridkv.config_specs import specs_from_config
from hybridkv.models.loader import build_model
from hybridkv.models.registry import family_module
from hybridkv.models.tiny import make_tiny_checkpoint
from model_harness import Harness, assert_close_rel, hf_logits

NAME = "olmo_hybrid"


def test_config_only_specs_equal_the_models_own(family_models):
    path, ours, _ = family_models(NAME)
    cfg = json.loads((path / "config.json").read_text())
    assert specs_from_config(cfg, torch.float32) == ours.cache_specs()


def test_nope_checkpoint_matches_transformers(tmp_path):
    """Published checkpoints carry rope_theta null: attention without rotary (NoPE)."""
    path = make_tiny_checkpoint(NAME, tmp_path, seed=13)
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": None}
    (path / "config.json").write_text(json.dumps(cfg))
    ours, hf = load_pair(path)
    assert hf.model.rotary_emb is None and ours.rotary is None
    check_prompt_logits(ours, hf, n=40, seed=1)
    check_ragged_batch_greedy(ours, hf, lengths=(1, BS + 1, 40), steps=8)


def test_beta_scale_and_whole_projection_qk_norm_change_the_logits(family_models):
    _, ours, hf = family_models(NAME)
    tokens = prompt(40, 1)
    ref = hf_logits(hf, tokens)

    def logits():
        h = Harness(ours)
        return h.step([(h.add(tokens), len(tokens))], return_all_logits=True)

    assert_close_rel(logits(), ref)
    gdn = ours.model.layers[0].linear_attn
    gdn.beta_scale = 1.0
    try:
        got = logits()
    finally:
        gdn.beta_scale = 2.0
    assert (got - ref).abs().max() > 1e-3 * ref.abs().max()
    attn = ours.model.layers[1].self_attn
    norm_over_all = attn.q_norm.forward

    def per_head(x):  # the same weights applied per head (the Qwen3 way) instead of over all heads
        T = x.shape[0]
        h = x.view(T, attn.num_heads, attn.head_dim).float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + attn.q_norm.eps)
        return attn.q_norm.weight * h.reshape(T, -1).to(x.dtype)

    attn.q_norm.forward = per_head
    try:
        got = logits()
    finally:
        attn.q_norm.forward = norm_over_all
    assert (got - ref).abs().max() > 1e-3 * ref.abs().max()


def test_configs_this_code_would_run_wrongly_are_refused():
    config = family_module(NAME).tiny_config(layer_types=["linear_attention", "sliding_attention"] * 2)
    with pytest.raises(ValueError, match="layer_types\\[1\\] is 'sliding_attention'"):
        build_model(config)
