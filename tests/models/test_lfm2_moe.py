"""LFM2-MoE's own checks: each routing detail (expert bias for the choice only, renormalisation,
routed_scaling_factor) moves the logits beyond the family check's tolerance, the config-only
planner equals the model's specs and configs it would run wrongly are refused. The shared checks
(the engine under memory pressure, a prefix hit and migration mid-decode among them) are its row in
test_families.py."""
import json

import pytest
import torch

from family_checks import prompt
from hybridkv.config_specs import specs_from_config
from hybridkv.models.loader import build_model
from hybridkv.models.registry import family_module
from model_harness import Harness, assert_close_rel, hf_logits

NAME = "lfm2_moe"


def test_config_only_specs_equal_the_models_own(family_models):
    path, ours, _ = family_models(NAME)
    cfg = json.loads((path / "config.json").read_text())
    assert specs_from_config(cfg, torch.float32) == ours.cache_specs()


def test_each_routing_detail_changes_the_logits(family_models):
    _, ours, hf = family_models(NAME)
    tokens = prompt(40, 1)
    ref = hf_logits(hf, tokens)
    moes = [layer.feed_forward for layer in ours.model.layers[1:]]
    assert all(m.expert_bias.abs().max() > 0 for m in moes)

    def logits():
        h = Harness(ours)
        return h.step([(h.add(tokens), len(tokens))], return_all_logits=True)

    assert_close_rel(logits(), ref)
    for field, wrong in [("expert_bias", None), ("norm_topk_prob", False), ("routed_scaling_factor", 1.0)]:
        right = [getattr(m, field) for m in moes]
        for m in moes:
            setattr(m, field, wrong)
        try:
            got = logits()
        finally:
            for m, r in zip(moes, right):
                setattr(m, field, r)
        assert (got - ref).abs().max() > 1e-3 * ref.abs().max(), field


@pytest.mark.parametrize("overrides, message", [
    (dict(layer_types=["conv", "sliding_attention", "conv", "conv"]), "layer_types\\[1\\] is 'sliding_attention'"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok=5 must be in \\[1, num_experts=4\\]"),
])
def test_configs_this_code_would_run_wrongly_are_refused(overrides, message):
    config = family_module(NAME).tiny_config(**overrides)
    with pytest.raises(ValueError, match=message):
        build_model(config)
