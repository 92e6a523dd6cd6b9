"""GLM-5-Next (KDA beside DSA latent attention with a k-pool indexer, hyper-connection streams)
against transformers' Glm5NextForConditionalGeneration on text: the planner's specs, the indexer's
selection mattering (and the unselected path equal to transformers' too), pools of 4 crossing
one-token chunks, a burst, the configs that would run otherwise than transformers refused, and
tensor parallelism refused by name. The shared checks (logits, ragged, chunks, checkpoints,
engine, pressure in both modes, prefix hit, migration to block size 8, in-memory names) are its row
in tests/family_checks.py; the zeroed KDA state moving the logits is in test_recurrent_paths_matter.py."""
import json
import shutil

import pytest
import torch

from hybridkv.config_specs import load_specs, specs_from_config
from hybridkv.models import load_model
from hybridkv.models.checkpoint import CheckpointError
from hybridkv.specs import AttentionSpec, RecurrentSpec

from family_checks import (check_burst_computes_the_shared_prefix_once, check_tensor_parallel_refused_by_name,
                           prompt)
from model_harness import Harness, assert_close_rel, hf_logits

NAME = "glm5_next"


def _logits(model, tokens, chunks=None):
    h = Harness(model)
    seq = h.add(tokens)
    return torch.cat([h.step([(seq, n)], return_all_logits=True) for n in (chunks or [len(tokens)])])


def test_planner_specs_equal_the_model(family_models):
    path, ours, _ = family_models(NAME)
    specs = ours.cache_specs()
    assert load_specs(path / "config.json", torch.float32) == specs
    kda = RecurrentSpec((3 * 2 * 16, 3), (2, 16, 16), torch.float32)
    latent = AttentionSpec(1, 32, torch.float32, latent=True)
    index = AttentionSpec(1, 16, torch.float32)  # layer 2 shares layer 1's selection: no pages
    assert specs == {0: kda, 1: latent, 2: latent, 3: kda, 4: latent, 6: index, 9: index}


def test_class_default_config_plans_by_hand():
    """transformers' defaults (GLM-5.3-Flash's shape; its published config is not available
    offline): 45 layers, every fourth DSA (latent of 512, indexer pages of 128), the rest KDA of
    64 heads x 128 with a 3-token conv window."""
    specs = specs_from_config({"model_type": "glm5_next", "text_config": {}}, torch.bfloat16)
    kda = RecurrentSpec((3 * 64 * 128, 3), (64, 128, 128), torch.bfloat16, torch.float32)
    dsa = [i for i in range(45) if i % 4 == 3]
    assert specs == {**{i: kda for i in range(45) if i % 4 != 3},
                     **{i: AttentionSpec(1, 512, torch.bfloat16, latent=True) for i in dsa},
                     **{45 + i: AttentionSpec(1, 128, torch.bfloat16) for i in dsa}}


def test_the_indexer_selection_matters_and_dense_equals_transformers(family_models):
    """53 tokens: the selection (2 pools of 4 + the tail) against every pool selected moves the
    logits; with every pool selected, ours and transformers' still agree."""
    _, ours, hf = family_models(NAME)
    tokens = prompt(53, 0)
    sparse = _logits(ours, tokens)
    indexers = [layer.self_attn.indexer for layer in ours.model.layers
                if layer.is_attention and layer.self_attn.indexer is not None]
    theirs = [layer.self_attn.indexer for layer in hf.model.language_model.layers
              if getattr(layer.self_attn, "indexer", None) is not None]
    try:
        for m in indexers:
            m.topk = 512
        for m in theirs:
            m.index_topk = 512
        dense = _logits(ours, tokens)
        assert_close_rel(dense, hf_logits(hf, tokens))
    finally:
        for m in indexers:
            m.topk = 8
        for m in theirs:
            m.index_topk = 8
    assert ((dense - sparse).abs().max() / sparse.abs().max()).item() > 0.01


def test_pools_cross_one_token_chunks(family_models):
    """Chunks of 1, 2 and 3 tokens complete pools of 4 across steps: every logit equals one pass."""
    _, ours, _ = family_models(NAME)
    tokens = prompt(29, 7)
    torch.testing.assert_close(_logits(ours, tokens, [1, 2, 3, 1, 1, 5, 3, 4, 9]), _logits(ours, tokens),
                               rtol=1e-4, atol=1e-4)


def test_burst_computes_the_shared_prefix_once(family_models):
    """Three prompts sharing 40 tokens arrive together: the followers wait for the leader's
    checkpoint at 32 (latent and indexer pages, the KDA state) and resume there."""
    path, _, hf = family_models(NAME)
    check_burst_computes_the_shared_prefix_once(path, hf)


def test_tensor_parallel_is_refused_by_name(family_models):
    path, _, _ = family_models(NAME)
    check_tensor_parallel_refused_by_name(path, "Glm5NextForConditionalGeneration")


@pytest.mark.parametrize("change, message", [
    (dict(indexer_types=["full", "full", "shared", "shared", "full"], layer_types=[
        "linear_attention", "indexed_attention", "linear_attention", "indexed_attention", "indexed_attention"]),
     r"indexer_types\[3\] is 'shared' but layer 2 is not an indexed_attention layer"),
    (dict(index_kpool_always_select_tail=False), "index_kpool_always_select_tail=False"),
])
def test_configs_run_otherwise_are_refused(family_models, tmp_path, change, message):
    path, _, _ = family_models(NAME)
    shutil.copytree(path, tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"].update(change)
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises((CheckpointError, ValueError), match=message):
        load_model(tmp_path / "ckpt")
