"""Kimi-Linear's own checks (layout, the latent KV kind and its planner bytes, the config-only plan,
prefix hits and migration with latent pages beside KDA states); the shared ones, the engine under
memory pressure among them, are its row in test_families.py."""
import json

import pytest
import torch

from hybridkv import LLM
from hybridkv.config_specs import specs_from_config
from hybridkv.models.kda_mixer import KimiDeltaAttentionMixer
from hybridkv.models.kimi_linear import KimiLinearModel, KimiMoE, tiny_config
from hybridkv.plan import kv_bytes_per_token
from hybridkv.scheduler.snapshot_io import snapshot_from_bytes, snapshot_to_bytes
from hybridkv.specs import AttentionSpec, RecurrentSpec

from engine_fixtures import assert_no_leaks, greedy
from family_checks import BS, prompt
from model_harness import assert_greedy_matches_hf

KDA = RecurrentSpec((3 * 2 * 16, 3), (2, 16, 16), torch.float32)  # conv over q|k|v, [H, K, K]
LATENT = AttentionSpec(1, 32 + 8, torch.float32, latent=True)  # kv_lora_rank + rope dims


def test_layout_latent_kind_and_config_only_plan(family_models):
    path, ours, hf = family_models("kimi_linear")
    layers = ours.model.layers
    assert [isinstance(layer.self_attn, KimiDeltaAttentionMixer) for layer in layers] == [
        True, False, True, False]
    assert [isinstance(layer.mlp, KimiMoE) for layer in layers] == [False, True, True, True]
    assert ours.cache_specs() == {0: KDA, 1: LATENT, 2: KDA, 3: LATENT}
    # the planner sizes pages by the latent: 40 floats per token and layer, where per-head K and V
    # of the 4 heads would be 2 x 4 x (16 + 8) = 192
    assert kv_bytes_per_token(ours.cache_specs()) == 2 * 40 * 4
    cfg = json.loads((path / "config.json").read_text())
    assert specs_from_config(cfg, torch.float32) == ours.cache_specs()
    bf16 = specs_from_config(cfg, torch.bfloat16)
    assert bf16[0].ssm_dtype == torch.float32 and bf16[1].bytes_per_token() == 40 * 2
    torch.testing.assert_close(ours.model.layers[1].mlp.gate.e_score_correction_bias,
                               hf.model.layers[1].mlp.gate.e_score_correction_bias, rtol=0, atol=0)
    assert hf.model.layers[1].mlp.gate.e_score_correction_bias.abs().max() > 0


def test_unknown_layer_types_are_refused():
    config = tiny_config()
    config.mlp_layer_types = ["dense", "sparse", "moe", "sparse"]
    with pytest.raises(ValueError, match=r"mlp_layer_types\[2\] is 'moe'"):
        KimiLinearModel(config)
    config = tiny_config()
    config.layer_types = ["linear_attention", "sliding_attention"] * 2
    with pytest.raises(ValueError, match=r"layer_types\[1\] is 'sliding_attention'"):
        KimiLinearModel(config)
    with pytest.raises(ValueError, match="mla_use_nope=False"):
        KimiLinearModel(tiny_config(mla_use_nope=False))
    cfg = dict(config.to_dict(), model_type="kimi_linear")
    with pytest.raises(ValueError, match="kimi_linear layer 1 has type 'sliding_attention'"):
        specs_from_config(cfg, torch.float32)


def test_prefix_hit_shares_latent_pages_and_resumes_the_kda_state(family_models):
    path, _, hf = family_models("kimi_linear")
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


def test_migration_mid_decode_moves_latents_and_kda_states(family_models):
    path, _, hf = family_models("kimi_linear")
    src = LLM(str(path), memory_budget_bytes=8 << 20, max_num_batched_tokens=32)
    dst = LLM(str(path), memory_budget_bytes=8 << 20, block_size=32)  # another block size
    prompts = [prompt(n, 90 + n) for n in (1, BS - 1, BS + 1, 3 * BS + 5)]
    ids = [src.add_request(p, greedy(12)) for p in prompts]
    for _ in range(5):  # prefill (the long prompt in two chunks) and a few decodes
        src.step()
    for i in ids[1:3]:
        snap = snapshot_from_bytes(snapshot_to_bytes(src.export_request(i)))
        assert snap.num_computed_tokens > snap.num_prompt_tokens  # mid-decode
        assert set(snap.kv) == {1, 3} and set(snap.ssm) == {0, 2} == set(snap.conv)
        # token-major latents: one vector of 40 per token, not [2, T, heads, head_dim]
        assert snap.kv[1].shape == (1, snap.num_computed_tokens, 1, 40)
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
