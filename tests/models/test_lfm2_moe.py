"""LFM2-MoE's own checks: each routing detail (expert bias for the choice only, renormalisation,
routed_scaling_factor) moves the logits beyond the family check's tolerance, the config-only
planner equals the model's specs, configs it would run wrongly are refused, and the engine under
memory pressure, a prefix hit and migration mid-decode. The shared checks are its row in
test_families.py."""
import json

import pytest
import torch

from engine_fixtures import assert_no_leaks, greedy, tight_budget
from family_checks import BS, prompt
from hybridkv import LLM
from hybridkv.config_specs import specs_from_config
from hybridkv.models.loader import build_model
from hybridkv.models.registry import family_module
from hybridkv.scheduler.snapshot_io import snapshot_from_bytes, snapshot_to_bytes
from model_harness import Harness, assert_close_rel, assert_greedy_matches_hf, hf_logits

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


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_engine_under_memory_pressure(mode, family_models):
    path, ours, hf = family_models(NAME)
    prompts = [prompt(n, 50 + n) for n in (1, BS - 1, BS + 1, 3 * BS + 5, 40)]
    llm = LLM(str(path), memory_budget_bytes=tight_budget(ours.cache_specs(), BS, blocks=6, slots=1 + 3),
              max_num_seqs=3, max_num_batched_tokens=24, preemption_mode=mode, checkpoint_share=0.0)
    outs = llm.generate(prompts, greedy(12), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert assert_greedy_matches_hf(hf, p, o.outputs[0].token_ids) == 0
    assert llm.stats()["preemptions"][mode] > 0
    assert_no_leaks(llm)


def test_prefix_hit_and_migration_mid_decode(family_models):
    path, _, hf = family_models(NAME)
    src = LLM(str(path), memory_budget_bytes=4 << 20, checkpoint_policy="prompt_end",
              max_num_batched_tokens=32)
    shared = prompt(40, 61)
    first, second = shared + prompt(3, 62), shared + prompt(6, 63)
    a = src.generate([first], greedy(8), use_tqdm=False)[0]
    rid = src.add_request(second, greedy(12))
    for _ in range(4):  # the suffix past the hit, then decodes
        src.step()
    snap = snapshot_from_bytes(snapshot_to_bytes(src.export_request(rid)))
    assert snap.num_computed_tokens > snap.num_prompt_tokens
    dst = LLM(str(path), memory_budget_bytes=4 << 20, block_size=8)  # another block size
    dst.import_request(snap)
    out = None
    while dst.has_unfinished_requests():
        out = next((o for o in dst.step() if o.finished), out)
    assert src.stats()["prefix_hit_tokens"] == 2 * BS
    for p, o in ((first, a), (second, out)):
        assert assert_greedy_matches_hf(hf, p, o.outputs[0].token_ids) == 0
    assert_no_leaks(src)
    assert_no_leaks(dst)
