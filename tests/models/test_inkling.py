"""Inkling (v1 text model: relative-bias attention with short convs, sliding + full, MoE with a
shared expert in the routing) against transformers: the planner's specs, the parts that must
matter (the relative bias, the log scaling, the conv windows), other options and bfloat16, a long
generation holding only the window in sliding layers, a burst, and tensor parallelism refused by
name. The shared checks (logits, ragged, chunks, checkpoints, engine, pressure in both modes, prefix
hit, migration to block size 8) are its row in tests/family_checks.py."""
import json
import shutil

import pytest
import torch

from hybridkv import LLM
from hybridkv.config_specs import load_specs, specs_from_config
from hybridkv.models import load_model
from hybridkv.specs import AttentionSpec, RecurrentSpec

from engine_fixtures import assert_no_leaks, greedy
from family_checks import (BS, WINDOW, check_burst_computes_the_shared_prefix_once,
                           check_tensor_parallel_refused_by_name, generate_holding_the_window, load_pair,
                           prompt)
from hybridkv.models.tiny import make_tiny_checkpoint
from model_harness import Harness, assert_close_rel, assert_greedy_matches_hf, hf_logits

NAME = "inkling"


def _logits(model, tokens):
    h = Harness(model)
    return h.step([(h.add(tokens), len(tokens))], return_all_logits=True)


def _moved(got, ref) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


def test_planner_specs_equal_the_model(family_models):
    path, ours, _ = family_models(NAME)
    specs = ours.cache_specs()
    assert load_specs(path / "config.json", torch.float32) == specs
    sliding, full = AttentionSpec(1, 32, torch.float32, WINDOW), AttentionSpec(2, 16, torch.float32)
    assert [specs[i] for i in range(4)] == [sliding, full, sliding, full]
    # four conv windows of 3: k and v (kv width 32 in both kinds), attention and feed-forward (64)
    assert {specs[4 + i] for i in range(4)} == {RecurrentSpec((2 * 32 + 2 * 64, 3), (), torch.float32)}


def test_class_default_config_plans_by_hand():
    """transformers' defaults (the published config is not available offline): 66 layers, full
    attention where (i + 1) % 6 == 0 (8 KV heads of 128), sliding 512 elsewhere (16 of 128); per
    layer float32 conv windows of 3 over 2 x 2048 (or 2 x 1024) + 2 x 6144 channels."""
    specs = specs_from_config({"model_type": "inkling_text"}, torch.bfloat16)
    full = [i for i in range(66) if specs[i].sliding_window is None]
    assert full == list(range(5, 66, 6))
    assert specs[5] == AttentionSpec(8, 128, torch.bfloat16) and specs[0] == AttentionSpec(16, 128, torch.bfloat16, 512)
    assert specs[66] == RecurrentSpec((2 * 2048 + 2 * 6144, 3), (), torch.float32)
    assert specs[66 + 5] == RecurrentSpec((2 * 1024 + 2 * 6144, 3), (), torch.float32)


def _with_config(path, tmp_path, **changes):
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_relative_bias_log_scaling_and_conv_windows_matter(family_models, tmp_path):
    """Each moves the logits by more than 1%: the bias bank zeroed; log scaling off; the conv
    windows zeroed after 32 of 53 tokens (the next 21 tokens' logits)."""
    path, ours, _ = family_models(NAME)
    tokens = prompt(3 * WINDOW + 5, 0)
    ref = _logits(ours, tokens)
    banks = [layer.self_attn.rel_logits_proj.proj for layer in ours.model.layers]
    saved = [b.detach().clone() for b in banks]
    with torch.no_grad():
        for b in banks:
            b.zero_()
    try:
        assert _moved(_logits(ours, tokens), ref) > 0.01
    finally:
        with torch.no_grad():
            for b, v in zip(banks, saved):
                b.copy_(v)
    unscaled = load_model(_with_config(path, tmp_path / "unscaled", log_scaling_n_floor=None))
    assert _moved(_logits(unscaled, tokens), ref) > 0.01
    tokens = prompt(53, 0)
    runs = []
    for reset in (False, True):
        h = Harness(ours)
        seq = h.add(tokens)
        h.step([(seq, 32)])
        if reset:
            for pool in h.caches.conv.values():
                pool[seq.slot].zero_()
        runs.append(h.step([(seq, 21)], return_all_logits=True))
    assert _moved(runs[1], runs[0]) > 0.01


@pytest.mark.parametrize("overrides", [
    dict(log_scaling_n_floor=None, mlp_layer_types=["dense"] * 4, unpadded_vocab_size=None, vocab_size=128),
    dict(n_shared_experts=2, num_experts_per_tok=1, conv_kernel_size=2, rel_extent=100, d_rel=4),
])
def test_other_options_match_transformers(overrides, tmp_path):
    """Dense feed-forwards everywhere, no log scaling, an unpadded head; two shared experts with
    top-1 routing, a 2-tap conv, a relative extent past the prompt; both in two chunks."""
    ours, hf = load_pair(make_tiny_checkpoint(NAME, tmp_path, seed=4, **overrides), "eager")
    tokens = prompt(2 * WINDOW + 3, 1)
    h = Harness(ours)
    seq = h.add(tokens)
    got = torch.cat([h.step([(seq, 20)], return_all_logits=True), h.step([(seq, 31)], return_all_logits=True)])
    assert_close_rel(got, hf_logits(hf, tokens))


def test_bfloat16_keeps_the_convs_and_routing_bias_in_float32(family_models):
    from transformers import AutoModelForCausalLM

    path, _, _ = family_models(NAME)
    ours = load_model(path, dtype=torch.bfloat16)
    layer = ours.model.layers[1]
    assert layer.attn_sconv.conv1d.weight.dtype == layer.self_attn.k_sconv.conv1d.weight.dtype == torch.float32
    assert layer.mlp.gate.e_score_correction_bias.dtype == layer.mlp.gate.global_scale.dtype == torch.float32
    assert layer.self_attn.q_proj.weight.dtype == torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    tokens = prompt(BS + 5, 2)
    assert_close_rel(_logits(ours, tokens), hf_logits(hf, tokens), rtol=3e-2)


# long (a 40-token decode past the window, 1-3 s): the slow tier, with this family's table rows
# (tests/models/test_families.py SLOW); the fast tier checks the window rule on granitemoe_swa and zaya
@pytest.mark.slow
def test_long_generation_holds_the_window_then_a_prefix_hit(family_models):
    path, _, hf = family_models(NAME)
    llm = LLM(str(path), memory_budget_bytes=4 << 20, max_num_batched_tokens=20)
    base = prompt(70, 64)
    out = generate_holding_the_window(llm, base, 40)
    assert assert_greedy_matches_hf(hf, base, out.outputs[0].token_ids) == 0
    again = llm.generate([base + [9, 9]], greedy(6), use_tqdm=False)[0]
    assert again.num_cached_tokens == 64  # both KV groups' blocks and the conv windows at 64
    assert assert_greedy_matches_hf(hf, base + [9, 9], again.outputs[0].token_ids) == 0
    assert_no_leaks(llm)


def test_burst_computes_the_shared_prefix_once(family_models):
    path, _, hf = family_models(NAME)
    check_burst_computes_the_shared_prefix_once(path, hf)


def test_tensor_parallel_is_refused_by_name(family_models):
    path, _, _ = family_models(NAME)
    check_tensor_parallel_refused_by_name(path, "InklingForCausalLM")


def test_published_multimodal_checkpoint_serves_its_text_model(tmp_path):
    """An `InklingForConditionalGeneration` checkpoint (text config nested, vision and audio towers,
    the text weights under the published `model.llm.` names with interleaved gate / up rows) loads
    as the text model with the logits of transformers' multimodal model on text; the config-only
    plan is the model's."""
    import transformers
    from safetensors.torch import load_file
    from transformers.models.inkling.configuration_inkling import InklingConfig

    from hybridkv.models.registry import family_module

    text = family_module(NAME).tiny_config().to_dict()
    text.pop("architectures")
    config = InklingConfig(text_config=text, architectures=["InklingForConditionalGeneration"],
                           vision_config=dict(text_hidden_size=64, patch_size=4, hidden_size=32, num_hidden_layers=1,
                                              num_attention_heads=2),
                           audio_config=dict(text_hidden_size=64, n_mel_bins=4, mel_vocab_size=8))
    torch.manual_seed(4)
    mm = transformers.InklingForConditionalGeneration(config)
    with torch.no_grad():
        for p in mm.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    mm.save_pretrained(str(tmp_path))
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert "model.llm.layers.0.mlp.w13_dn.weight" in stored and "model.llm.layers.1.mlp.shared_experts.shared_w13_weight" in stored
    ours = load_model(tmp_path)
    assert ours.architecture == "InklingForCausalLM"
    hf = transformers.InklingForConditionalGeneration.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                                      attn_implementation="eager").eval()
    tokens = prompt(BS + 5, 3)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([tokens])).logits[0].float()
    assert_close_rel(_logits(ours, tokens), want[:, :ours.vocab_size])
    assert load_specs(tmp_path / "config.json", torch.float32) == ours.cache_specs()


@pytest.mark.parametrize("layer", [0, 1])
def test_feed_forward_equals_transformers(family_models, layer):
    """Layer 0's dense MLP (times global_scale) and layer 1's MoE (sigmoid routing with the
    correction bias, shared expert inside the normalisation) against transformers' modules on the
    same input; the bias randomised so it changes choices."""
    _, ours, hf = family_models(NAME)
    mine, theirs = ours.model.layers[layer].mlp, hf.model.layers[layer].mlp
    x = torch.randn(45, hf.config.hidden_size, generator=torch.Generator().manual_seed(layer)) * 3
    biases = [m.gate.e_score_correction_bias for m in (mine, theirs)] if layer == 1 else []
    saved = [b.clone() for b in biases]
    with torch.no_grad():
        for b in biases:
            b.copy_(torch.randn(4, generator=torch.Generator().manual_seed(7)) * 0.2)
        try:
            got, want = mine(x), theirs(x[None])[0]
        finally:
            for b, v in zip(biases, saved):
                b.copy_(v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
