"""Zamba (v1)'s own checks: cache keys (a multi-head Mamba state per layer, a KV cache per use of
the one shared block) equal the config-only planner's, the block is stored once and serves every
hybrid layer, the interleaved in_proj split and per-head B/C matter, and configs it would run
wrongly are refused. The shared checks (the engine under memory pressure, a prefix hit and
migration mid-decode among them) are its row in test_families.py."""
import json

import pytest
import torch
from safetensors.torch import load_file

from family_checks import prompt
from hybridkv.config_specs import specs_from_config
from hybridkv.models.loader import build_model
from hybridkv.models.registry import family_module
from hybridkv.specs import AttentionSpec, RecurrentSpec
from model_harness import Harness, assert_close_rel, hf_logits

NAME = "zamba"


def test_cache_keys_and_the_planner(family_models):
    path, ours, _ = family_models(NAME)
    mamba = RecurrentSpec((64, 3), (2, 32, 8), torch.float32)
    attn = AttentionSpec(4, 16, torch.float32)  # head_dim = 2H / heads
    want = {**{i: mamba for i in range(5)}, 5 + 1: attn, 5 + 3: attn}
    assert ours.cache_specs() == want
    cfg = json.loads((path / "config.json").read_text())
    assert specs_from_config(cfg, torch.float32) == want


def test_shared_block_stored_once_serves_every_hybrid_layer(family_models):
    path, ours, _ = family_models(NAME)
    names = load_file(str(path / "model.safetensors"))
    assert "model.layers.1.shared_transf.self_attn.q_proj.weight" in names
    assert not any(k.startswith("model.layers.3.shared_transf.") for k in names)
    assert ours.model.layers[1].shared_transf is ours.model.layers[3].shared_transf


def test_interleaved_split_per_head_projections_and_the_scans_change_the_logits(family_models):
    """Reading in_proj as [x | gate] halves, giving every head head 0's x_proj, or dropping the
    scans (x_proj zero: B = C = 0) moves the logits far beyond the family check's tolerance: that
    check does see all three."""
    _, ours, hf = family_models(NAME)
    tokens = prompt(30, 2)
    ref = hf_logits(hf, tokens)

    def logits():
        h = Harness(ours)
        return h.step([(h.add(tokens), len(tokens))], return_all_logits=True)

    assert_close_rel(logits(), ref)
    mixer = ours.model.layers[0].mamba
    for param, wrong in [
        (mixer.in_proj.weight, lambda w: w.view(64, 2, 32).transpose(0, 1).reshape(128, 32)),
        (mixer.x_proj_weight, lambda w: w[:1].expand_as(w).clone()),
        (mixer.x_proj_weight, torch.zeros_like),
    ]:
        right = param.data.clone()
        with torch.no_grad():
            param.copy_(wrong(param.data))
        try:
            got = logits()
        finally:
            with torch.no_grad():
                param.copy_(right)
        assert (got - ref).abs().max() > 3e-3 * ref.abs().max()


@pytest.mark.parametrize("overrides, message", [
    (dict(layers_block_type=["linear_attention", "full_attention", "linear_attention",
                             "hybrid", "linear_attention"]), "layers_block_type\\[1\\] is 'full_attention'"),
    (dict(hidden_mamba_act="gelu"), "hidden_mamba_act='gelu'"),
])
def test_configs_this_code_would_run_wrongly_are_refused(overrides, message):
    config = family_module(NAME).tiny_config(**overrides)
    with pytest.raises(ValueError, match=message):
        build_model(config)
