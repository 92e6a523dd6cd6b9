"""Mistral's own checks (the window in its specs, that the window changes the outputs, a config
without a window); the shared ones are its row in test_families.py."""
import json

import torch
from transformers import AutoModelForCausalLM, MistralConfig

from family_checks import WINDOW, check_prompt_logits, load_pair, prompt
from hybridkv.config_specs import specs_from_config
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.specs import AttentionSpec
from model_harness import Harness, assert_close_rel, hf_logits


def test_cache_specs_carry_the_window(family_models):
    path, ours, _ = family_models("mistral")
    specs = ours.cache_specs()
    assert specs == {i: AttentionSpec(2, 16, torch.float32, WINDOW) for i in range(2)}
    cfg = json.loads((path / "config.json").read_text())
    assert specs_from_config(cfg, torch.float32) == specs  # the planner sees the same window


def test_window_changes_the_outputs(family_models):
    """Without the window transformers' logits agree with ours on the first WINDOW positions only:
    the oracle comparison in test_families.py does exercise the window."""
    path, ours, _ = family_models("mistral")
    no_window = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, sliding_window=None,
                                                     attn_implementation="eager").eval()
    tokens = prompt(3 * WINDOW + 5, 0)
    h = Harness(ours)
    logits = h.step([(h.add(tokens), len(tokens))], return_all_logits=True)
    ref = hf_logits(no_window, tokens)
    assert_close_rel(logits[:WINDOW], ref[:WINDOW])
    assert (logits[WINDOW:] - ref[WINDOW:]).abs().max() > 0.1 * ref.abs().max()


def test_config_without_a_window(tmp_path):
    """`sliding_window: null` is plain causal attention; a config.json that omits the field gets
    transformers' MistralConfig default, as from_pretrained would."""
    path = make_tiny_checkpoint("mistral", tmp_path, seed=5, sliding_window=None)
    ours, hf = load_pair(path, "eager")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["sliding_window"] is None
    assert ours.cache_specs() == specs_from_config(cfg, torch.float32) == \
        {i: AttentionSpec(2, 16, torch.float32) for i in range(2)}
    check_prompt_logits(ours, hf, n=3 * WINDOW + 5, seed=2)
    del cfg["sliding_window"]
    default = MistralConfig().sliding_window
    assert default is not None
    assert specs_from_config(cfg, torch.float32) == {i: AttentionSpec(2, 16, torch.float32, default)
                                                     for i in range(2)}
