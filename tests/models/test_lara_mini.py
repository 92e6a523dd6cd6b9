"""Lara Mini's own checks against transformers' model of the same tiny checkpoint: the planner equals
the model's specs (GDN slots and two KV groups), the MoE (float32 router, ungated shared expert)
layer for layer, the rope-less full-attention layers matter, options this code would run wrongly
are refused by name, and a long generation whose sliding layers hold only their window. The
shared checks (the engine under memory pressure, a prefix hit and migration mid-decode among them)
are its row in test_families.py."""
import json

import pytest
import torch

from engine_fixtures import assert_no_leaks
from family_checks import WINDOW, generate_holding_the_window, prompt
from hybridkv import LLM
from hybridkv.config_specs import specs_from_config
from hybridkv.models.checkpoint import CheckpointError
from hybridkv.models.loader import build_model
from hybridkv.models.registry import family_module
from hybridkv.specs import RecurrentSpec
from model_harness import Harness, assert_close_rel, assert_greedy_matches_hf, hf_logits

NAME = "lara_mini"
LAYERS = ["linear_attention", "sliding_attention", "linear_attention", "full_attention", "sliding_attention"]


def test_config_only_specs_equal_the_models_own(family_models):
    path, ours, _ = family_models(NAME)
    cfg = json.loads((path / "config.json").read_text())
    specs = ours.cache_specs()
    assert specs_from_config(cfg, torch.float32) == specs
    kinds = ["gdn" if isinstance(s, RecurrentSpec) else s.sliding_window for s in specs.values()]
    assert kinds == ["gdn", WINDOW, "gdn", None, WINDOW]


def test_moe_layer_equals_transformers(family_models):
    _, ours, hf = family_models(NAME)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, hf.config.hidden_size, generator=g) * 3
    for i in (0, 3):
        with torch.no_grad():
            want = hf.model.layers[i].mlp(x[None])[0]
            got = ours.model.layers[i].mlp(x)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_full_attention_layers_without_rope_matter(family_models):
    """Giving the full-attention layer the sliding layers' rope moves the logits: the NoPE path is
    exercised, not hidden by the tolerance."""
    _, ours, hf = family_models(NAME)
    tokens = prompt(3 * WINDOW + 5, 3)
    ref = hf_logits(hf, tokens)

    def logits():
        h = Harness(ours)
        return h.step([(h.add(tokens), len(tokens))], return_all_logits=True)

    assert_close_rel(logits(), ref)
    full = ours.model.layers[3]
    assert full.kind == "full_attention"
    full.kind = "sliding_attention"  # now it gets the rope (its window stays None)
    try:
        got = logits()
    finally:
        full.kind = "full_attention"
    assert (got - ref).abs().max() > 1e-3 * ref.abs().max()


@pytest.mark.parametrize("overrides, message", [
    (dict(layer_types=LAYERS[:4] + ["conv"]), r"layer_types\[4\] is 'conv'"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
     "rope_parameters.rope_type='linear' is not supported"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "rope_parameters.partial_rotary_factor=0.5 is not supported"),
])
def test_options_this_code_would_run_wrongly_are_refused(overrides, message):
    config = family_module(NAME).tiny_config(**overrides)
    with pytest.raises(CheckpointError, match=message):
        build_model(config)


def test_published_fused_in_proj_with_wrong_rows_is_refused(family_models, tmp_path):
    """A fused `in_proj` whose rows do not match the config's GDN is named, not silently split."""
    import shutil

    from safetensors.torch import load_file, save_file

    path, _, _ = family_models(NAME)
    shutil.copytree(path, tmp_path / "ckpt")
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.linear_attn.in_proj.weight"
    tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, str(tmp_path / "ckpt" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"{name} has 199 rows; the config's GDN needs 200"):
        LLM(str(tmp_path / "ckpt"), memory_budget_bytes=1 << 20)


def test_long_generation_holds_the_window_in_sliding_layers(family_models):
    path, _, hf = family_models(NAME)
    llm = LLM(str(path), memory_budget_bytes=4 << 20, max_num_batched_tokens=20)
    base = prompt(70, 64)
    out = generate_holding_the_window(llm, base, 50)
    assert assert_greedy_matches_hf(hf, base, out.outputs[0].token_ids) == 0
    assert_no_leaks(llm)


def test_bfloat16_norms_and_routing_follow_transformers(family_models):
    """In bfloat16 the norms apply their weight in float32 before the cast (bit-equal to
    transformers'), and the router's logits are float32: the same experts are chosen."""
    import copy

    _, ours, hf = family_models(NAME)
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(41, hf.config.hidden_size, generator=g) * 3).bfloat16()
    norm_hf = copy.deepcopy(hf.model.layers[1].input_layernorm).bfloat16()
    norm_ours = copy.deepcopy(ours.model.layers[1].input_layernorm).bfloat16()
    q_hf = copy.deepcopy(hf.model.layers[1].self_attn.q_norm).bfloat16()
    q_ours = copy.deepcopy(ours.model.layers[1].self_attn.q_norm).bfloat16()
    heads = x.view(41, -1, 16)
    with torch.no_grad():
        assert torch.equal(norm_ours(x), norm_hf(x))
        assert torch.equal(q_ours(heads), q_hf(heads))
        for i in (0, 1):
            moe_hf = copy.deepcopy(hf.model.layers[i].mlp).bfloat16()
            moe_ours = copy.deepcopy(ours.model.layers[i].mlp).bfloat16()
            _, want_w, want_ids = moe_hf.gate(x)
            got_w, got_ids = moe_ours.route(x)
            assert torch.equal(got_ids, want_ids)
            assert torch.equal(got_w.to(torch.bfloat16), want_w)
            want, got = moe_hf(x[None])[0].float(), moe_ours(x).float()
            assert (got - want).abs().max() <= 2e-2 * want.abs().max()


def test_options_it_runs_match_transformers(tmp_path):
    """Unnormalised top-k weights, attention biases and a model without sliding layers (no rope
    anywhere) against transformers."""
    from family_checks import check_prompt_logits, load_pair, tiny_lara_mini

    path = tiny_lara_mini(NAME, tmp_path, seed=17, norm_topk_prob=False, attention_bias=True,
                          layer_types=["linear_attention", "full_attention"] * 2 + ["linear_attention"])
    ours, hf = load_pair(path, "eager")
    assert ours.rotary is None
    check_prompt_logits(ours, hf, n=40, seed=4)
