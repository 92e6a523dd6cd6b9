"""Zaya (CCA attention + top-1 MoE with a router state across layers) against transformers: the
planner's specs, the router module with its skip class, the CCA conv window mattering, other
options, a long generation holding only the window in sliding layers, a burst, the skip-class bias
transformers forces, and tensor parallelism refused by name. The shared checks (logits, ragged,
chunks, checkpoints, engine, pressure in both modes, prefix hit, migration to block size 8) are its
row in tests/family_checks.py; the zeroed delayed values moving the logits is in
test_recurrent_paths_matter.py."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridkv import LLM
from hybridkv.config_specs import load_specs, specs_from_config
from hybridkv.models import load_model
from hybridkv.models.checkpoint import CheckpointError
from hybridkv.specs import AttentionSpec, RecurrentSpec

from engine_fixtures import assert_no_leaks, greedy
from family_checks import (BS, WINDOW, check_burst_computes_the_shared_prefix_once,
                           check_tensor_parallel_refused_by_name, generate_holding_the_window, load_pair,
                           prompt, tiny_zaya)
from model_harness import Harness, assert_close_rel, assert_greedy_matches_hf, hf_logits

NAME = "zaya"


def _logits(model, tokens):
    h = Harness(model)
    return h.step([(h.add(tokens), len(tokens))], return_all_logits=True)


def test_planner_specs_equal_the_model(family_models):
    path, ours, _ = family_models(NAME)
    specs = ours.cache_specs()
    assert load_specs(path / "config.json", torch.float32) == specs
    cca = RecurrentSpec((4 * 16 + 2 * 16, 2), (16,), torch.float32)  # q|k window of 2; half a KV width
    assert specs == {**{i: AttentionSpec(2, 16, torch.float32, WINDOW if i % 2 == 0 else None) for i in range(4)},
                     **{4 + i: cca for i in range(4)}}


def test_class_default_config_plans_by_hand():
    """transformers' defaults (ZAYA1-8B's shape; its published config is not available offline):
    40 full-attention layers of 2 KV heads x 128, each with a 2-token window over q|k (8 + 2 heads
    of 128) and a delayed value of 128."""
    specs = specs_from_config({"model_type": NAME}, torch.bfloat16)
    assert specs == {**{i: AttentionSpec(2, 128, torch.bfloat16) for i in range(40)},
                     **{40 + i: RecurrentSpec((1280, 2), (128,), torch.bfloat16) for i in range(40)}}


def test_router_with_its_skip_class_equals_transformers(family_models):
    """Layer 1's router (with the previous layer's router state) against transformers' module on the
    same input, its skip class biased so that some tokens choose it: same expert, weight (0 for a
    skip) and router state."""
    _, ours, hf = family_models(NAME)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, hf.config.hidden_size, generator=g)
    prev = torch.randn(40, hf.config.router_hidden_size, generator=g)
    mine, theirs = ours.model.layers[1].mlp.gate, hf.model.layers[1].mlp.gate
    saved = (mine.balancing_biases.clone(), theirs.balancing_biases.clone())
    try:
        for b in (mine.balancing_biases, theirs.balancing_biases):
            b[-1] = 0.12
        with torch.no_grad():
            w, ids, state = mine(x, prev)
            _, hf_w, hf_ids, hf_state = theirs(x[None], prev[None])
    finally:
        mine.balancing_biases.copy_(saved[0])
        theirs.balancing_biases.copy_(saved[1])
    assert 0 < int((w == 0).sum()) < 40  # some tokens skip, some do not
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(w, hf_w, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state, hf_state[0], rtol=1e-6, atol=1e-6)


def test_zeroed_cca_windows_move_the_logits(family_models):
    """The q|k conv windows (the slot's window part) zeroed after 32 of 53 tokens move the next 21
    tokens' logits by more than 1%."""
    _, ours, _ = family_models(NAME)
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
    assert (runs[1] - runs[0]).abs().max() > 0.01 * runs[0].abs().max()


@pytest.mark.parametrize("overrides", [
    dict(tie_word_embeddings=True, lm_head_bias=True, attention_bias=True, cca_time0=3, cca_time1=2),
    dict(layer_types=["hybrid"] * 3, num_hidden_layers=3, num_key_value_heads=4, cca_time0=2, cca_time1=3),
])
def test_other_options_match_transformers(overrides, tmp_path):
    """Tied embeddings, biases and a 3-tap depthwise conv; all-full attention, MHA, a 3-tap grouped
    conv; both prefilled in two chunks."""
    ours, hf = load_pair(tiny_zaya(NAME, tmp_path, seed=4, **overrides), "eager")
    tokens = prompt(2 * WINDOW + 3, 1)
    h = Harness(ours)
    seq = h.add(tokens)
    got = torch.cat([h.step([(seq, 20)], return_all_logits=True), h.step([(seq, 31)], return_all_logits=True)])
    assert_close_rel(got, hf_logits(hf, tokens))


def test_skip_class_bias_is_minus_one_as_transformers_forces_it(family_models, tmp_path):
    """A checkpoint whose skip-class balancing bias is 5 (every token would skip) loads with -1 in
    transformers (its _init_weights runs after loading) and here alike, and the logits agree."""
    path, _, _ = family_models(NAME)
    shutil.copytree(path, tmp_path / "ckpt")
    tensors = load_file(str(path / "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith("balancing_biases"):
            t = t.clone()
            t[-1] = 5.0
            tensors[name] = t
    save_file(tensors, str(tmp_path / "ckpt" / "model.safetensors"), metadata={"format": "pt"})
    ours, hf = load_pair(tmp_path / "ckpt", "eager")
    assert ours.model.layers[2].mlp.gate.balancing_biases[-1] == -1.0
    assert hf.model.layers[2].mlp.gate.balancing_biases[-1] == -1.0
    tokens = prompt(BS + 3, 5)
    assert_close_rel(_logits(ours, tokens), hf_logits(hf, tokens))


def test_long_generation_holds_the_window_then_a_prefix_hit(family_models):
    path, _, hf = family_models(NAME)
    llm = LLM(str(path), memory_budget_bytes=4 << 20, max_num_batched_tokens=20)
    base = prompt(70, 64)
    out = generate_holding_the_window(llm, base, 40)
    assert assert_greedy_matches_hf(hf, base, out.outputs[0].token_ids) == 0
    again = llm.generate([base + [9, 9]], greedy(6), use_tqdm=False)[0]
    assert again.num_cached_tokens == 64  # both KV groups' blocks and a CCA state at 64
    assert assert_greedy_matches_hf(hf, base + [9, 9], again.outputs[0].token_ids) == 0
    assert_no_leaks(llm)


def test_burst_computes_the_shared_prefix_once(family_models):
    """Three prompts sharing 40 tokens arrive together: the followers wait for the leader's
    checkpoint at 32 (KV blocks and the CCA state) and resume there."""
    path, _, hf = family_models(NAME)
    check_burst_computes_the_shared_prefix_once(path, hf)


def test_tensor_parallel_is_refused_by_name(family_models):
    path, _, _ = family_models(NAME)
    check_tensor_parallel_refused_by_name(path, "ZayaForCausalLM")


def test_unknown_layer_type_is_refused(family_models, tmp_path):
    path, _, _ = family_models(NAME)
    shutil.copytree(path, tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    cfg["layer_types"] = ["hybrid", "hybrid", "mamba", "hybrid"]
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"layer_types\[2\] is '\w+'; Zaya layers are one of"):
        load_model(tmp_path / "ckpt")
