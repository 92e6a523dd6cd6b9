"""BailingHybrid's (Ling 3) own checks (layout, latent KV beside KDA states and the config-only plan,
the un-bounded forget gate and plain q projection against transformers, refused options, the
snapshot of a migration); the shared ones, the engine under memory pressure and prefix hits among
them, are its row in test_families.py."""
import json

import pytest
import torch

from hybridkv.config_specs import specs_from_config
from hybridkv.models.bailing_delta_attention import BailingDeltaAttentionMixer
from hybridkv.models.bailing_hybrid import BailingHybridModel, tiny_config
from hybridkv.models.gated_latent_attention import GatedLatentAttention
from hybridkv.models.kimi_linear import KimiMoE
from hybridkv.plan import kv_bytes_per_token
from hybridkv.specs import AttentionSpec, RecurrentSpec

from family_checks import BS, check_migration_mid_decode, check_prompt_logits, load_pair, tiny_lfm2_moe

KDA = RecurrentSpec((3 * 4 * 16, 3), (4, 16, 16), torch.float32)  # conv over q|k|v, [H, K, K]
LATENT = AttentionSpec(1, 32 + 8, torch.float32, latent=True)  # kv_lora_rank + rotary dims


def test_layout_latent_kind_and_config_only_plan(family_models):
    path, ours, hf = family_models("bailing_hybrid")
    layers = ours.model.layers
    assert [isinstance(layer.self_attn, BailingDeltaAttentionMixer) for layer in layers] == [
        True, False, True, False]
    assert [isinstance(layer.self_attn, GatedLatentAttention) for layer in layers] == [
        False, True, False, True]
    assert [isinstance(layer.mlp, KimiMoE) for layer in layers] == [False, True, True, True]
    assert ours.cache_specs() == {0: KDA, 1: LATENT, 2: KDA, 3: LATENT}
    # 40 floats per token and latent layer, where per-head K and V would be 2 x 4 x (16 + 8)
    assert kv_bytes_per_token(ours.cache_specs()) == 2 * 40 * 4
    cfg = json.loads((path / "config.json").read_text())
    assert specs_from_config(cfg, torch.float32) == ours.cache_specs()
    assert specs_from_config(cfg, torch.bfloat16)[0].ssm_dtype == torch.float32
    # the published correction bias (`expert_bias`) reached the router, and it is not zero
    torch.testing.assert_close(ours.model.layers[1].mlp.gate.e_score_correction_bias,
                               hf.model.layers[1].mlp.gate.e_score_correction_bias, rtol=0, atol=0)
    assert hf.model.layers[1].mlp.gate.e_score_correction_bias.abs().max() > 0


def test_published_default_layer_pattern_plans_mla_every_group():
    """A config that leaves layer_types out: MLA on every layer_group_size-th layer, as transformers."""
    cfg = dict(tiny_config(num_hidden_layers=6, layer_types=None, mlp_layer_types=None,
                           layer_group_size=3).to_dict(), model_type="bailing_hybrid")
    cfg.pop("layer_types"), cfg.pop("mlp_layer_types")
    specs = specs_from_config(cfg, torch.float32)
    assert [isinstance(s, AttentionSpec) for s in specs.values()] == [False, False, True] * 2


def test_unbounded_gate_and_plain_q_projection_match_transformers(tmp_path):
    """kda_safe_gate=False (Kimi's -exp(A_log) * softplus gate) and q_lora_rank=None (one q_proj)."""
    path = tiny_lfm2_moe("bailing_hybrid", tmp_path, seed=14, kda_safe_gate=False, q_lora_rank=None)
    ours, hf = load_pair(path)
    assert not ours.model.layers[0].self_attn.forget_gate.safe
    assert hasattr(ours.model.layers[1].self_attn, "q_proj")
    check_prompt_logits(ours, hf, n=BS + 7)


def test_refused_options_name_themselves():
    # transformers' config validates layer types on construction; a loaded config can still hold others
    for name, bad, match in (("layer_types", ["linear_attention", "sliding_attention"] * 2,
                              r"layer_types\[1\] is 'sliding_attention'"),
                             ("mlp_layer_types", ["dense", "sparse", "moe", "sparse"],
                              r"mlp_layer_types\[2\] is 'moe'"),
                             ("num_key_value_heads", 2, "num_key_value_heads=2 differs"),
                             ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                              "rope_type is 'linear'")):
        config = tiny_config()
        setattr(config, name, bad)
        with pytest.raises(ValueError, match=match):
            BailingHybridModel(config)
    config = tiny_config()
    config.layer_types = ["linear_attention", "sliding_attention"] * 2
    cfg = dict(config.to_dict(), model_type="bailing_hybrid")
    with pytest.raises(ValueError, match="bailing_hybrid layer 1 has type 'sliding_attention'"):
        specs_from_config(cfg, torch.float32)


def test_migration_mid_decode_moves_latents_and_kda_states(family_models):
    path, _, hf = family_models("bailing_hybrid")

    def latents_and_kda_states(snap):
        assert set(snap.kv) == {1, 3} and set(snap.ssm) == {0, 2} == set(snap.conv)
        assert snap.kv[1].shape == (1, snap.num_computed_tokens, 1, 40)  # one latent per token

    check_migration_mid_decode(path, hf, latents_and_kda_states)


@pytest.mark.parametrize("changes, message", [
    (dict(layer_group_size=0), "layer_group_size=0; it must be a positive integer"),
    (dict(kv_lora_rank=-32), "kv_lora_rank=-32; it must be a positive integer"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2 differs"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "rope_type is 'linear'"),
])
def test_loading_refuses_a_config_it_would_run_wrongly(changes, message, family_models, tmp_path):
    """At load, before any weight is read: a CheckpointError naming config.json and the option."""
    import shutil

    from hybridkv.models import CheckpointError, load_model

    path, _, _ = family_models("bailing_hybrid")
    shutil.copytree(path, tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=f"config.json.*{message}"):
        load_model(tmp_path / "ckpt")
