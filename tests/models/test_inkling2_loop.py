"""Inkling 2 Loop (text model) against transformers: the virtual layers of the extra passes in the
planner and the model, the second pass mattering, its own KV pages and conv windows per pass, the
original checkpoint's names (`controllers.*`, two message-query tensors) loading the same, a long
generation holding only the window in sliding layers, and tensor parallelism refused by name. The
shared checks (logits, ragged, chunks, checkpoints, engine, pressure in both modes, prefix hit,
migration to block size 8) are its row in tests/family_checks.py: a loop over depth keeps every
pass's memory per token, so prefix reuse needs no exception."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridkv import LLM
from hybridkv.config_specs import load_specs, specs_from_config
from hybridkv.models import load_model
from hybridkv.specs import AttentionSpec, RecurrentSpec

from engine_fixtures import assert_no_leaks
from family_checks import WINDOW, check_tensor_parallel_refused_by_name, generate_holding_the_window, prompt
from model_harness import Harness, assert_greedy_matches_hf

NAME = "inkling2_loop"


def _logits(model, tokens):
    h = Harness(model)
    return h.step([(h.add(tokens), len(tokens))], return_all_logits=True)


def test_planner_specs_equal_the_model_with_a_virtual_layer_per_extra_pass(family_models):
    """6 layers, layers 2-3 twice: virtual layers 6 and 7 are their second pass (KV at 6, 7;
    windows at 8 + v)."""
    path, ours, _ = family_models(NAME)
    specs = ours.cache_specs()
    assert load_specs(path / "config.json", torch.float32) == specs
    sliding, full = AttentionSpec(1, 32, torch.float32, WINDOW), AttentionSpec(2, 16, torch.float32)
    assert [specs[v] for v in range(8)] == [sliding, full] * 4
    assert set(specs) == set(range(16))
    assert {specs[8 + v] for v in range(8)} == {RecurrentSpec((2 * 32 + 2 * 64, 3), (), torch.float32)}


def test_class_default_config_plans_by_hand():
    """transformers' defaults (Inkling-2-Mini's shape, not available offline): 24 layers of hidden
    2304, 6-17 looped 3 times: 48 virtual layers, 96 cache keys; 8 KV heads of 128 everywhere."""
    specs = specs_from_config({"model_type": "inkling2_loop_text"}, torch.bfloat16)
    assert set(specs) == set(range(96))
    assert specs[24] == specs[6] and specs[47] == specs[17] == AttentionSpec(8, 128, torch.bfloat16)
    assert specs[48 + 47] == RecurrentSpec((2 * 8 * 128 + 2 * 2304, 3), (), torch.float32)


def test_the_second_pass_and_its_memory_matter(family_models):
    """One pass instead of two moves the logits by more than 1%; so does zeroing only the second
    pass's conv windows (virtual layers 6 and 7) after 32 of 53 tokens."""
    _, ours, _ = family_models(NAME)
    tokens = prompt(3 * WINDOW + 5, 0)
    ref = _logits(ours, tokens)
    schedule = ours.schedule
    ours.schedule = [s for s in schedule if s[2] == 0]
    try:
        one = _logits(ours, tokens)
    finally:
        ours.schedule = schedule
    assert (one - ref).abs().max() > 0.01 * ref.abs().max()
    tokens = prompt(53, 0)
    runs = []
    for reset in (False, True):
        h = Harness(ours)
        seq = h.add(tokens)
        h.step([(seq, 32)])
        if reset:
            for v in (6, 7):
                h.caches.conv[ours.num_virtual + v][seq.slot].zero_()
        runs.append(h.step([(seq, 21)], return_all_logits=True))
    assert (runs[1] - runs[0]).abs().max() > 0.01 * runs[0].abs().max()


def test_original_checkpoint_names_load_the_same(family_models, tmp_path):
    """The looped layers' gates as `controllers.{attn,k,v,mlp}.{down,gain,forget}_weight` and the
    message queries as two [q, mlp] / [k, v] tensors: logits equal bit for bit."""
    path, ours, _ = family_models(NAME)
    shutil.copytree(path, tmp_path / "ckpt")
    tensors = load_file(str(path / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        for x, c in (("q", "attn"), ("k", "k"), ("v", "v"), ("mlp", "mlp")):
            for ours_name, theirs in (("down_proj", "down_weight"), ("message_gate_proj", "gain_weight"),
                                      ("forget_gate_proj", "forget_weight")):
                name = name.replace(f".{x}_message_gate.{ours_name}.weight", f".controllers.{c}.{theirs}")
        out[name] = t
    merged = out.pop("model.llm.message_input.query")  # [layers, (q, k, v, mlp), H]
    out["model.llm.middle_cycle_cross_pass_queries"] = merged[:, [0, 3]].flatten(0, 1).contiguous()
    out["model.llm.middle_cycle_cross_pass_kv_queries"] = merged[:, 1:3].flatten(0, 1).contiguous()
    assert any(".controllers.attn.gain_weight" in n for n in out)
    save_file(out, str(tmp_path / "ckpt" / "model.safetensors"), metadata={"format": "pt"})
    tokens = prompt(20, 9)
    assert torch.equal(_logits(load_model(tmp_path / "ckpt"), tokens), _logits(ours, tokens))


# long (a 40-token decode past the window, 1-3 s): the slow tier, with this family's table rows
# (tests/models/test_families.py SLOW); the fast tier checks the window rule on granitemoe_swa and zaya
@pytest.mark.slow
def test_long_generation_holds_the_window_in_every_pass(family_models):
    path, _, hf = family_models(NAME)
    llm = LLM(str(path), memory_budget_bytes=4 << 20, max_num_batched_tokens=20)
    base = prompt(70, 64)
    out = generate_holding_the_window(llm, base, 40)
    assert assert_greedy_matches_hf(hf, base, out.outputs[0].token_ids) == 0
    assert_no_leaks(llm)


def test_tensor_parallel_is_refused_by_name(family_models):
    path, _, _ = family_models(NAME)
    check_tensor_parallel_refused_by_name(path, "Inkling2LoopForCausalLM")
