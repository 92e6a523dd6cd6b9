"""Kimi-Linear's own checks (layout, the latent KV kind and its planner bytes, the config-only plan,
the snapshot of a migration with latent pages beside KDA states); the shared ones, the engine under
memory pressure and prefix hits among them, are its row in test_families.py."""
import json

import pytest
import torch

from hybridkv.config_specs import specs_from_config
from hybridkv.models.kda_mixer import KimiDeltaAttentionMixer
from hybridkv.models.kimi_linear import KimiLinearModel, KimiMoE, tiny_config
from hybridkv.plan import kv_bytes_per_token
from hybridkv.specs import AttentionSpec, RecurrentSpec

from family_checks import check_migration_mid_decode

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


def test_migration_mid_decode_moves_latents_and_kda_states(family_models):
    path, _, hf = family_models("kimi_linear")

    def latents_and_kda_states(snap):
        assert set(snap.kv) == {1, 3} and set(snap.ssm) == {0, 2} == set(snap.conv)
        # token-major latents: one vector of 40 per token, not [2, T, heads, head_dim]
        assert snap.kv[1].shape == (1, snap.num_computed_tokens, 1, 40)

    check_migration_mid_decode(path, hf, latents_and_kda_states)
