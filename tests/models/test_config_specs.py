"""Config-only specs: which layers get a window follows transformers' config classes (the
equality with each older model's own cache_specs() is checked in test_mistral.py and
tests/engine/test_compare_baseline.py; the newer families' here, on the family fixtures)."""
import pytest
import torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from hybridkv.config_specs import specs_from_config
from hybridkv.plan import state_bytes_per_slot
from hybridkv.specs import AttentionSpec, RecurrentSpec

BASE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
            vocab_size=128, sliding_window=100)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
@pytest.mark.parametrize("fields", [dict(), dict(use_sliding_window=False),
                                    dict(use_sliding_window=True, max_window_layers=2)])
def test_windows_where_transformers_puts_them(model_type, fields):
    cfg = dict(BASE, model_type=model_type, **fields)
    hf = CONFIG_MAPPING[model_type](**{k: v for k, v in cfg.items() if k != "model_type"})
    window = {"sliding_attention": hf.sliding_window, "full_attention": None}
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    want = {i: AttentionSpec(2, head_dim, torch.float32, window[t]) for i, t in enumerate(hf.layer_types)}
    assert specs_from_config(cfg, torch.float32) == want
    windows = [s.sliding_window for s in want.values()]
    assert windows == ([None, None, 100, 100] if fields.get("use_sliding_window") else [None] * 4)


def test_llama_has_no_window():
    """transformers' Llama ignores a stray `sliding_window` field, and so do we."""
    specs = specs_from_config(dict(BASE, model_type="llama"), torch.float32)
    assert all(s.sliding_window is None for s in specs.values())


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "mamba", "mamba2", "falcon_mamba",
                                    "recurrent_gemma"])
def test_config_only_specs_equal_the_models_own(family, family_models):
    import json

    path, ours, _ = family_models(family)
    cfg = json.loads((path / "config.json").read_text())
    assert specs_from_config(cfg, torch.float32) == ours.cache_specs()


@pytest.mark.parametrize("family, model_type", [("qwen3_5", "qwen3_5"), ("qwen3_5_moe", "qwen3_5_moe")])
def test_published_multimodal_qwen3_5_config_plans_its_text_model(family, model_type, family_models):
    """Published Qwen3.5 checkpoints nest the text model under `text_config`; the plan is its."""
    _, ours, _ = family_models(family)
    text = {k: v for k, v in ours.config.to_dict().items() if k != "architectures"}
    nested = CONFIG_MAPPING[model_type](text_config=text).to_dict()
    assert nested["model_type"] == model_type and "text_config" in nested
    assert specs_from_config(nested, torch.float32) == ours.cache_specs()


def test_pure_recurrent_defaults_hand_computed():
    """transformers' defaults (Mamba-130m-like v1, Mamba-Codestral-like v2): every layer a state,
    no attention layer; sizes worked out by hand."""
    m1 = specs_from_config({"model_type": "mamba"}, torch.bfloat16)  # hidden 768, expand 2, 32 layers
    assert len(m1) == 32 and set(m1.values()) == {RecurrentSpec((1536, 3), (1536, 16), torch.bfloat16)}
    m2 = specs_from_config({"model_type": "mamba2"}, torch.bfloat16)  # 128 heads x 64, 8 groups, N 128
    assert len(m2) == 64
    assert set(m2.values()) == {RecurrentSpec((8192 + 2 * 8 * 128, 3), (128, 64, 128), torch.bfloat16)}
    assert state_bytes_per_slot(m2) == 64 * (10240 * 3 + 128 * 64 * 128) * 2  # 131.75 MiB per request


def test_new_published_configs_hand_computed():
    """examples/configs for RecurrentGemma-2B, LFM2-8B-A1B and Zamba-7B-v1 (bf16), sizes by hand."""
    from pathlib import Path

    from hybridkv.config_specs import load_specs
    from hybridkv.contiguous import bytes_per_request
    from hybridkv.plan import kv_bytes_per_token

    configs = Path(__file__).resolve().parents[2] / "examples" / "configs"
    rg = load_specs(configs / "recurrentgemma-2b.json")
    windowed = [i for i, s in rg.items() if isinstance(s, AttentionSpec)]
    assert windowed == list(range(2, 26, 3)) and {rg[i].sliding_window for i in windowed} == {2048}
    assert kv_bytes_per_token(rg) == 8 * 2 * 1 * 256 * 2  # MQA, head_dim 2560 / 10
    lru = RecurrentSpec((2560, 3), (2560,), torch.bfloat16, torch.float32)
    assert state_bytes_per_slot(rg) == 18 * (2560 * 3 * 2 + 2560 * 4) == 18 * lru.bytes_per_slot()
    assert bytes_per_request(rg, 4096) == bytes_per_request(rg, 32768)  # only the window is held

    lfm = load_specs(configs / "lfm2-8b-a1b.json")
    assert sorted(i for i, s in lfm.items() if isinstance(s, AttentionSpec)) == [2, 6, 10, 14, 18, 21]
    assert kv_bytes_per_token(lfm) == 6 * 2 * 8 * 64 * 2 and state_bytes_per_slot(lfm) == 18 * 2048 * 2 * 2

    zamba = load_specs(configs / "zamba-7b-v1.json")
    hybrid = sorted(k - 76 for k in zamba if k >= 76)  # attention use sites, keyed 76 + layer
    assert hybrid == [2] + [i for i in range(3, 76) if (i - 3) % 6 == 4] and len(hybrid) == 13
    assert kv_bytes_per_token(zamba) == 13 * 2 * 16 * 464 * 2  # heads of 2H / 16 = 464
    assert state_bytes_per_slot(zamba) == 76 * (7424 * 3 * 2 + 2 * 3712 * 16 * 2)
