"""Inkling 2 (text model) against transformers: the planner's specs, the parts that must matter
(block attention residuals, per-query sinks, dynamic conv taps, the conv windows), a long generation
holding only the window in sliding layers, a burst, and tensor parallelism refused by name. The
shared checks (logits, ragged, chunks, checkpoints, engine, pressure in both modes, prefix hit,
migration to block size 8, and transformers' in-memory names loading as the published ones) are
its row in tests/family_checks.py."""
import pytest
import torch

from hybridkv import LLM
from hybridkv.config_specs import load_specs, specs_from_config
from hybridkv.specs import AttentionSpec, RecurrentSpec

from engine_fixtures import assert_no_leaks, greedy
from family_checks import (BS, WINDOW, check_burst_computes_the_shared_prefix_once,
                           check_tensor_parallel_refused_by_name, generate_holding_the_window, prompt)
from model_harness import Harness, assert_greedy_matches_hf

NAME = "inkling2"


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
    assert {specs[4 + i] for i in range(4)} == {RecurrentSpec((2 * 32 + 2 * 64, 3), (), torch.float32)}


def test_class_default_config_plans_by_hand():
    """transformers' defaults (Inkling-2-Small's shape; the published config is not available
    offline): 48 layers, full attention where (i + 1) % 6 == 0, sliding 1024 elsewhere, 8 KV heads
    of 128 in both; float32 conv windows of 3 over 2 x 1024 + 2 x 4608 channels."""
    specs = specs_from_config({"model_type": "inkling2_text"}, torch.bfloat16)
    assert [i for i in range(48) if specs[i].sliding_window is None] == list(range(5, 48, 6))
    assert specs[0] == AttentionSpec(8, 128, torch.bfloat16, 1024) and specs[5] == AttentionSpec(8, 128, torch.bfloat16)
    assert {specs[48 + i] for i in range(48)} == {RecurrentSpec((2 * 1024 + 2 * 4608, 3), (), torch.float32)}


@pytest.mark.parametrize("part", ["attention_input.query", "mlp_input.query", "sink_proj.weight",
                                  "sconv.weight_proj.weight", "sconv.static_weight"])
def test_each_part_moves_the_logits(part, family_models):
    """Zeroing each of these (all layers) moves a 3-window prompt's logits by more than 1%, so the
    family checks (1e-4) would see it run wrongly."""
    _, ours, _ = family_models(NAME)
    tokens = prompt(3 * WINDOW + 5, 0)
    ref = _logits(ours, tokens)
    params = [p for n, p in ours.named_parameters() if n.endswith(part)]
    assert params
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.zero_()
    try:
        assert _moved(_logits(ours, tokens), ref) > 0.01
    finally:
        with torch.no_grad():
            for p, v in zip(params, saved):
                p.copy_(v)


def test_zeroed_conv_windows_move_the_logits(family_models):
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
    assert _moved(runs[1], runs[0]) > 0.01


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
    assert again.num_cached_tokens == 64
    assert assert_greedy_matches_hf(hf, base + [9, 9], again.outputs[0].token_ids) == 0
    assert_no_leaks(llm)


def test_burst_computes_the_shared_prefix_once(family_models):
    path, _, hf = family_models(NAME)
    check_burst_computes_the_shared_prefix_once(path, hf)


def test_tensor_parallel_is_refused_by_name(family_models):
    path, _, _ = family_models(NAME)
    check_tensor_parallel_refused_by_name(path, "Inkling2ForCausalLM")


@pytest.mark.parametrize("family", ["inkling2", "inkling2_loop"])
def test_published_multimodal_checkpoint_serves_its_text_model(family, tmp_path):
    """An `...ForConditionalGeneration` checkpoint (text config nested, a vision tower, the text
    weights under `model.llm.`) loads as the text model with the logits of transformers' multimodal
    model on text alone; the config-only plan is the model's."""
    import transformers
    from safetensors.torch import load_file
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from hybridkv.config_specs import load_specs
    from hybridkv.models import load_model
    from hybridkv.models.registry import family_module
    from model_harness import assert_close_rel

    text = family_module(family).tiny_config().to_dict()
    text.pop("architectures")
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, text_hidden_size=64,
                  projection_hidden_dim=32, patch_size=4, posemb_grid_size=4)
    arch = {"inkling2": "Inkling2ForConditionalGeneration", "inkling2_loop": "Inkling2LoopForConditionalGeneration"}[family]
    config = CONFIG_MAPPING[family](text_config=text, vision_config=vision, architectures=[arch])
    torch.manual_seed(4)
    vl = getattr(transformers, arch)(config)
    with torch.no_grad():
        for p in vl.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    vl.save_pretrained(str(tmp_path))
    assert any(k.startswith("model.llm.layers.") for k in load_file(str(tmp_path / "model.safetensors")))
    ours = load_model(tmp_path)
    assert ours.architecture == family_module(family).ARCHITECTURE
    hf = getattr(transformers, arch).from_pretrained(str(tmp_path), dtype=torch.float32, attn_implementation="eager").eval()
    tokens = prompt(BS + 5, 3)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([tokens])).logits[0].float()
    assert_close_rel(_logits(ours, tokens), want)
    assert load_specs(tmp_path / "config.json", torch.float32) == ours.cache_specs()


def test_moe_with_softcapped_experts_equals_transformers(family_models):
    """Layer 1's MoE (sigmoid routing renormalised over the top k, softcapped SwiGLU experts through
    fused_moe's glu) against transformers' block on the same input."""
    _, ours, hf = family_models(NAME)
    x = torch.randn(45, hf.config.hidden_size, generator=torch.Generator().manual_seed(3)) * 3
    with torch.no_grad():
        got, want = ours.model.layers[1].mlp(x), hf.model.layers[1].mlp(x[None])[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
