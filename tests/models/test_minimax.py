"""MiniMax's own checks (layout, decay rates, the config-only plan, prefix hits and migration with
lightning states beside KV); the shared ones, the engine under memory pressure among them, are its
row in test_families.py."""
import json

import pytest
import torch

from hybridkv import LLM
from hybridkv.config_specs import specs_from_config
from hybridkv.models.lightning_mixer import LightningAttentionMixer
from hybridkv.models.minimax import MiniMaxModel, tiny_config
from hybridkv.scheduler.snapshot_io import snapshot_from_bytes, snapshot_to_bytes
from hybridkv.specs import AttentionSpec, RecurrentSpec

from engine_fixtures import assert_no_leaks, greedy
from family_checks import BS, prompt
from model_harness import assert_greedy_matches_hf

LIGHTNING = RecurrentSpec((), (4, 16, 16), torch.float32)  # [heads, keys, values], no conv window
ATTENTION = AttentionSpec(2, 16, torch.float32)


def test_layout_specs_and_config_only_plan(family_models):
    path, ours, _ = family_models("minimax")
    layers = ours.model.layers
    assert [isinstance(layer.self_attn, LightningAttentionMixer) for layer in layers] == [
        True, False, True, False]
    assert ours.cache_specs() == {0: LIGHTNING, 1: ATTENTION, 2: LIGHTNING, 3: ATTENTION}
    assert LIGHTNING.bytes_per_slot() == 4 * 16 * 16 * 4
    cfg = json.loads((path / "config.json").read_text())
    assert specs_from_config(cfg, torch.float32) == ours.cache_specs()


def test_decay_rates_and_router_equal_transformers(family_models):
    _, ours, hf = family_models("minimax")
    for i in (0, 2):
        torch.testing.assert_close(ours.model.layers[i].self_attn._slopes,
                                   hf.model.layers[i].self_attn.slope_rate.view(-1), rtol=0, atol=0)
    torch.testing.assert_close(ours.model.layers[1].mlp.router.weight,
                               hf.model.layers[1].mlp.gate.weight, rtol=0, atol=0)


def test_unknown_layer_type_is_refused():
    config = tiny_config()
    config.layer_types = ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"layer_types\[1\] is 'sliding_attention'"):
        MiniMaxModel(config)
    cfg = dict(config.to_dict(), model_type="minimax")
    with pytest.raises(ValueError, match="minimax layer 1 has type 'sliding_attention'"):
        specs_from_config(cfg, torch.float32)


@pytest.mark.parametrize("option", [dict(rotary_dim=8), dict(postnorm=False),
                                    dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                          "partial_rotary_factor": 0.5})])
def test_options_transformers_ignores_are_refused(option):
    """Partial rotary and pre-norm residuals: transformers' MiniMax ignores them, so a checkpoint
    trained with them would run wrongly; loading refuses it, naming the option."""
    name = "postnorm" if "postnorm" in option else "rotary_dim"
    with pytest.raises(ValueError, match=name):
        MiniMaxModel(tiny_config(**option))


def test_prefix_hit_resumes_from_the_lightning_state_and_shared_kv(family_models):
    path, _, hf = family_models("minimax")
    llm = LLM(str(path), memory_budget_bytes=8 << 20, checkpoint_policy="prompt_end")
    shared = prompt(40, 31)
    first, second = shared + prompt(5, 32), shared + prompt(9, 33)
    a = llm.generate([first], greedy(8), use_tqdm=False)[0]
    b = llm.generate([second], greedy(8), use_tqdm=False)[0]
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 2 * BS
    assert llm.stats()["prefix_hit_tokens"] == 2 * BS
    for p, o in ((first, a), (second, b)):
        assert assert_greedy_matches_hf(hf, p, o.outputs[0].token_ids) == 0
    assert_no_leaks(llm)


def test_migration_mid_decode_moves_kv_and_lightning_states(family_models):
    path, _, hf = family_models("minimax")
    src = LLM(str(path), memory_budget_bytes=8 << 20, max_num_batched_tokens=32)
    dst = LLM(str(path), memory_budget_bytes=8 << 20, block_size=32)  # another block size
    prompts = [prompt(n, 90 + n) for n in (1, BS - 1, BS + 1, 3 * BS + 5)]
    ids = [src.add_request(p, greedy(12)) for p in prompts]
    for _ in range(5):  # prefill (the long prompt in two chunks) and a few decodes
        src.step()
    moving = ids[1:3]
    for i in moving:
        snap = snapshot_from_bytes(snapshot_to_bytes(src.export_request(i)))
        assert snap.num_computed_tokens > snap.num_prompt_tokens  # mid-decode
        assert set(snap.kv) == {1, 3} and set(snap.ssm) == {0, 2} and snap.conv == {}
        assert snap.ssm[0].shape == (4, 16, 16) and snap.ssm[0].abs().max() > 0
        dst.import_request(snap)
    done = {}
    for llm in (src, dst):
        while llm.has_unfinished_requests():
            for o in llm.step():
                if o.finished:
                    done[o.request_id] = list(o.outputs[0].token_ids)
    for p, i in zip(prompts, ids):
        assert assert_greedy_matches_hf(hf, p, done[i]) == 0
    assert src.stats()["migrations"]["out"] == 2 and dst.stats()["migrations"]["in"] == 2
    assert_no_leaks(src)
    assert_no_leaks(dst)
