"""Mamba / FalconMamba's own checks; the shared ones are their rows in test_families.py and the
zero-KV engine checks are in test_pure_recurrent.py."""
import json
import shutil


from hybridkv.models import load_model
from model_harness import Harness
from family_checks import prompt


def _logits(model, tokens):
    h = Harness(model)
    return h.step([(h.add(tokens), len(tokens))], return_all_logits=True)


def test_falcon_mamba_norms_have_no_weights_and_change_the_output(family_models, tmp_path):
    """FalconMamba's dt/B/C norms add no parameter; the same weights run as plain Mamba (no norms)
    give other logits, so the family check against transformers sees them."""
    path, falcon, hf = family_models("falcon_mamba")
    names = {n for n, _ in falcon.named_parameters()}
    assert not any("layernorm" in n for n in names)
    tied = {"lm_head.weight"}  # a copy of the embeddings here, the same tensor in transformers
    assert names - tied == {n for n, _ in hf.named_parameters()} - tied
    shutil.copytree(path, tmp_path / "as_mamba")
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(model_type="mamba", architectures=["MambaForCausalLM"])
    cfg.pop("mixer_rms_eps")
    (tmp_path / "as_mamba" / "config.json").write_text(json.dumps(cfg))
    plain = load_model(tmp_path / "as_mamba")
    tokens = prompt(20, 3)
    a, b = _logits(falcon, tokens), _logits(plain, tokens)
    assert (a - b).abs().max() > 0.1 * a.abs().max()


def test_pure_recurrent_max_model_len_is_not_zero(family_models):
    """Mamba configs have no max_position_embeddings; the engine still gets a positive length."""
    for name in ("mamba", "mamba2", "falcon_mamba"):
        _, ours, _ = family_models(name)
        assert ours.max_model_len >= 1 << 20


def test_configs_this_code_would_run_wrongly_are_refused():
    """(transformers itself refuses a Mamba2 config whose heads do not tile expand x hidden.)"""
    import pytest

    from hybridkv.models.loader import build_model
    from hybridkv.models.registry import family_module

    bad = [("mamba", dict(hidden_act="gelu"), "hidden_act='gelu'"),
           ("mamba", dict(intermediate_size=100), "intermediate_size=100 is not a multiple"),
           ("qwen3_5", dict(layer_types=["linear_attention", "sliding_attention"] * 2),
            "layer_types\\[1\\] is 'sliding_attention'")]
    for family, overrides, message in bad:
        config = family_module(family).tiny_config(**overrides)
        with pytest.raises(ValueError, match=message):
            build_model(config)
