"""GraniteMoeSWA (sliding + full attention with sinks, a rope base per layer, MoE) against
transformers' model of the same tiny checkpoint: the planner's specs, the parts that must matter
(sinks, window, per-layer rope bases), Granite's published expert names, a long generation that
holds only the window in its sliding group, a burst, and tensor parallelism refused by name. The
shared checks (logits, ragged batches, chunks, engine, pressure, prefix hit and migration) are its
row in tests/family_checks.py."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridkv import LLM
from hybridkv.config_specs import load_specs, specs_from_config
from hybridkv.models import load_model
from hybridkv.specs import AttentionSpec

from engine_fixtures import assert_no_leaks, greedy
from family_checks import (BS, WINDOW, check_burst_computes_the_shared_prefix_once,
                           check_tensor_parallel_refused_by_name, generate_holding_the_window, load_pair,
                           prompt)
from model_harness import Harness, assert_close_rel, assert_greedy_matches_hf, hf_logits

NAME = "granitemoe_swa"


def _logits(model, tokens):
    h = Harness(model)
    return h.step([(h.add(tokens), len(tokens))], return_all_logits=True)


def _moved(got, ref) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


def _with_config(path, tmp_path, **changes):
    """A copy of checkpoint `path` whose config.json has `changes`."""
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_planner_specs_equal_the_model_and_alternate_windows(family_models):
    path, ours, _ = family_models(NAME)
    specs = ours.cache_specs()
    assert load_specs(path / "config.json", torch.float32) == specs
    assert [s.sliding_window for s in specs.values()] == [WINDOW, None, WINDOW, None]


def test_class_default_config_plans_by_hand():
    """transformers' defaults (no published config is available offline): 32 layers, full
    attention where i % 4 == 0, window 128 elsewhere, 32 KV heads of 4096 / 32 = 128."""
    specs = specs_from_config({"model_type": NAME}, torch.bfloat16)
    full = AttentionSpec(32, 128, torch.bfloat16)
    sliding = AttentionSpec(32, 128, torch.bfloat16, 128)
    assert specs == {i: full if i % 4 == 0 else sliding for i in range(32)}


def test_sinks_window_and_rope_bases_each_matter(family_models, tmp_path):
    """Each of the family's parts moves the logits of a 3-window prompt by more than 1%, so the
    family checks (1e-4) would see it run wrongly: sinks zeroed, the window widened past the
    prompt, every layer on one rope base."""
    path, ours, _ = family_models(NAME)
    tokens = prompt(3 * WINDOW + 5, 0)
    ref = _logits(ours, tokens)
    sinks = [layer.self_attn.sinks for layer in ours.model.layers]
    saved = [s.detach().clone() for s in sinks]
    with torch.no_grad():
        for s in sinks:
            s.zero_()
    try:
        assert _moved(_logits(ours, tokens), ref) > 0.01
    finally:
        with torch.no_grad():
            for s, v in zip(sinks, saved):
                s.copy_(v)
    wide = load_model(_with_config(path, tmp_path / "wide", sliding_window=4096))
    assert _moved(_logits(wide, tokens), ref) > 0.01
    one_base = load_model(_with_config(path, tmp_path / "one_base", layer_rope_theta=[10000.0] * 4))
    assert _moved(_logits(one_base, tokens), ref) > 0.01


@pytest.mark.parametrize("overrides", [dict(shared_intermediate_size=0, attention_bias=True),
                                       dict(layer_rope_theta=[0, 0, 0, 0], num_key_value_heads=4)])
def test_other_options_match_transformers(overrides, tmp_path):
    """No shared MLP with attention biases; no rope at all with plain multi-head attention."""
    from family_checks import tiny_granitemoe_swa

    ckpt = tiny_granitemoe_swa(NAME, tmp_path, seed=3, **overrides)
    ours, hf = load_pair(ckpt, "eager")
    tokens = prompt(2 * WINDOW + 3, 1)
    assert_close_rel(_logits(ours, tokens), hf_logits(hf, tokens))


def test_published_granite_expert_names_load_the_same(family_models, tmp_path):
    """Granite's published MoE names (`input_linear`, `output_linear`, `router.layer`) hold the
    same tensors under other names; the model loads them bit for bit."""
    path, ours, _ = family_models(NAME)
    shutil.copytree(path, tmp_path / "ckpt")
    renames = {".block_sparse_moe.experts.gate_up_proj": ".block_sparse_moe.input_linear.weight",
               ".block_sparse_moe.experts.down_proj": ".block_sparse_moe.output_linear.weight",
               ".block_sparse_moe.router.weight": ".block_sparse_moe.router.layer.weight"}
    tensors = {}
    for name, t in load_file(str(path / "model.safetensors")).items():
        for new, old in renames.items():
            name = name.replace(new, old)
        tensors[name] = t
    assert "model.layers.0.block_sparse_moe.input_linear.weight" in tensors
    save_file(tensors, str(tmp_path / "ckpt" / "model.safetensors"), metadata={"format": "pt"})
    tokens = prompt(BS + 3, 9)
    assert torch.equal(_logits(load_model(tmp_path / "ckpt"), tokens), _logits(ours, tokens))


def test_long_generation_holds_the_window_then_a_prefix_hit(family_models):
    path, _, hf = family_models(NAME)
    llm = LLM(str(path), memory_budget_bytes=4 << 20, max_num_batched_tokens=20)
    base = prompt(70, 64)
    out = generate_holding_the_window(llm, base, 40)
    assert assert_greedy_matches_hf(hf, base, out.outputs[0].token_ids) == 0
    again = llm.generate([base + [9, 9]], greedy(6), use_tqdm=False)[0]
    assert again.num_cached_tokens == 64  # both groups' blocks up to the last full one
    assert assert_greedy_matches_hf(hf, base + [9, 9], again.outputs[0].token_ids) == 0
    assert_no_leaks(llm)


def test_burst_computes_the_shared_prefix_once(family_models):
    """Three prompts sharing 40 tokens arrive together: the followers wait for the leader's blocks
    and resume at 32; all tokens are transformers'."""
    path, _, hf = family_models(NAME)
    check_burst_computes_the_shared_prefix_once(path, hf)


def test_tensor_parallel_is_refused_by_name(family_models):
    path, _, _ = family_models(NAME)
    check_tensor_parallel_refused_by_name(path, "GraniteMoeSWAForCausalLM")


def test_unknown_layer_type_is_refused():
    from hybridkv.models.loader import build_model
    from hybridkv.models.registry import family_module

    config = family_module(NAME).tiny_config(layer_types=["sliding_attention", "full_attention",
                                                          "linear_attention", "full_attention"])
    with pytest.raises(ValueError, match=r"layer_types\[2\] is 'linear_attention'"):
        build_model(config)
