"""MiniMax's own checks (layout, decay rates, the config-only plan, the snapshot of a migration with
lightning states beside KV); the shared ones, the engine under memory pressure and prefix hits
among them, are its row in test_families.py."""
import json

import pytest
import torch

from hybridkv.config_specs import specs_from_config
from hybridkv.models.lightning_mixer import LightningAttentionMixer
from hybridkv.models.minimax import MiniMaxModel, tiny_config
from hybridkv.specs import AttentionSpec, RecurrentSpec

from family_checks import check_migration_mid_decode

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


def test_migration_mid_decode_moves_kv_and_lightning_states(family_models):
    path, _, hf = family_models("minimax")

    def kv_and_lightning_states(snap):
        assert set(snap.kv) == {1, 3} and set(snap.ssm) == {0, 2} and snap.conv == {}
        assert snap.ssm[0].shape == (4, 16, 16) and snap.ssm[0].abs().max() > 0

    check_migration_mid_decode(path, hf, kv_and_lightning_states)
