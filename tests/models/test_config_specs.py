"""Config-only specs of the attention-only families: which layers get a window follows
transformers' config classes (the equality with each model's own cache_specs() is checked in
test_mistral.py and tests/test_compare_baseline.py)."""
import pytest
import torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from hybridkv.config_specs import specs_from_config
from hybridkv.specs import AttentionSpec

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
