"""Qwen4-Exp (GDN beside QSA attention, PLE n-gram embeddings, gated hyper-connection streams)
against transformers: the planner's specs, the QSA selection mattering (and every block selected
equal to transformers' too), the PLE slot mattering, n-grams across an EOS and chunk edges, a
published multimodal checkpoint serving its text model, a burst, and tensor parallelism refused by
name. The shared checks (logits, ragged, chunks, checkpoints, engine, pressure in both modes, prefix
hit, migration to block size 8, in-memory names) are its row in tests/family_checks.py; the zeroed
states moving the logits is in test_recurrent_paths_matter.py."""
import pytest
import torch

from hybridkv.config_specs import load_specs, specs_from_config
from hybridkv.models import load_model
from hybridkv.specs import AttentionSpec, RecurrentSpec

from family_checks import (BS, check_burst_computes_the_shared_prefix_once, check_tensor_parallel_refused_by_name,
                           prompt)
from model_harness import Harness, assert_close_rel, hf_logits

NAME = "qwen4_exp"


def _logits(model, tokens, chunks=None):
    h = Harness(model)
    seq = h.add(tokens)
    return torch.cat([h.step([(seq, n)], return_all_logits=True) for n in (chunks or [len(tokens)])])


def _moved(got, ref) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


def test_planner_specs_equal_the_model(family_models):
    path, ours, _ = family_models(NAME)
    specs = ours.cache_specs()
    assert load_specs(path / "config.json", torch.float32) == specs
    gdn = RecurrentSpec((2 * 2 * 16 + 4 * 16, 3), (4, 16, 16), torch.float32)
    ple = RecurrentSpec((2 * 64, 3 * 3), (2,), torch.float32, torch.float32)
    kv, index = AttentionSpec(2, 16, torch.float32), AttentionSpec(1, 16, torch.float32, latent=True)
    assert specs == {0: gdn, 1: kv, 2: gdn, 3: kv, 4: ple, 5: index, 6: ple, 7: index}


def test_class_default_shape_plans_by_hand():
    """transformers' default shape (its published config is not available offline) with a QSA
    indexer (the defaults leave it unset, which the planner and the model refuse) and PLE on layer 1."""
    cfg = {"model_type": "qwen4_exp_text", "indexer_n_heads": 16, "indexer_kv_heads": 1, "indexer_head_dim": 256,
           "indexer_budget": 2048, "indexer_compress_ratio": 16, "ple_layer_ids": [1], "eos_token_id": 1}
    specs = specs_from_config(cfg, torch.bfloat16)
    gdn = RecurrentSpec((2 * 16 * 128 + 32 * 128, 3), (32, 128, 128), torch.bfloat16)
    dense = [i for i in range(40) if i % 4 == 3]
    assert specs == {**{i: gdn for i in range(40) if i % 4 != 3},
                     **{i: AttentionSpec(2, 256, torch.bfloat16) for i in dense},
                     **{40 + i: AttentionSpec(1, 256, torch.bfloat16, latent=True) for i in dense},
                     40: RecurrentSpec((4 * 2048, 9), (2,), torch.bfloat16, torch.float32)}
    with pytest.raises(ValueError, match="no QSA indexer fields"):
        specs_from_config({"model_type": "qwen4_exp_text"}, torch.bfloat16)


def test_the_qsa_selection_matters_and_dense_equals_transformers(family_models):
    _, ours, hf = family_models(NAME)
    tokens = prompt(53, 0)
    sparse = _logits(ours, tokens)
    mine = [layer.self_attn.indexer for layer in ours.model.layers if layer.is_attention]
    theirs = [layer.self_attn.indexer for layer in hf.model.layers if hasattr(layer, "self_attn")]
    try:
        for m in mine:
            m.budget = 512
        for m in theirs:
            m.token_budget, m.block_topk = 512, 512 // m.compress_ratio
        dense = _logits(ours, tokens)
        assert_close_rel(dense, hf_logits(hf, tokens))
    finally:
        for m in mine:
            m.budget = 8
        for m in theirs:
            m.token_budget, m.block_topk = 8, 8 // m.compress_ratio
    assert _moved(dense, sparse) > 0.01


def test_a_zeroed_ple_slot_moves_the_logits(family_models):
    """The PLE slots alone (conv window and the last two ids) zeroed after 32 of 53 tokens."""
    _, ours, _ = family_models(NAME)
    tokens, n = prompt(53, 0), len(ours.model.layers)
    runs = []
    for reset in (False, True):
        h = Harness(ours)
        seq = h.add(tokens)
        h.step([(seq, 32)])
        if reset:
            for i, layer in enumerate(ours.model.layers):
                if getattr(layer, "ple", None) is not None:
                    h.caches.conv[n + i][seq.slot].zero_()
                    h.caches.state[n + i][seq.slot].zero_()
        runs.append(h.step([(seq, 21)], return_all_logits=True))
    assert _moved(runs[1], runs[0]) > 0.01


def test_ngrams_across_eos_and_chunk_edges(family_models):
    """EOS (id 2) inside the prompt, chunks ending on it and right after it: transformers' logits."""
    _, ours, hf = family_models(NAME)
    tokens = prompt(40, 5)
    for p in (6, 7, 20, 31):
        tokens[p] = 2
    got = _logits(ours, tokens, [7, 1, 13, 11, 8])
    assert_close_rel(got, hf_logits(hf, tokens))


def test_published_multimodal_checkpoint_serves_its_text_model(tmp_path):
    """Qwen4ExpForConditionalGeneration (model.language_model. names, nested text_config) on text."""
    from transformers import Qwen4ExpConfig, Qwen4ExpForConditionalGeneration

    from hybridkv.models.qwen4_exp import tiny_config
    from hybridkv.models.tiny import make_tiny_tokenizer

    text = tiny_config().to_dict()
    for key in ("architectures", "model_type", "transformers_version"):
        text.pop(key, None)
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64,
                  num_position_embeddings=64)
    config = Qwen4ExpConfig(text_config=text, vision_config=vision, architectures=["Qwen4ExpForConditionalGeneration"])
    torch.manual_seed(3)
    hf = Qwen4ExpForConditionalGeneration(config).eval()
    hf.save_pretrained(str(tmp_path))
    make_tiny_tokenizer(tmp_path, 128)
    ours = load_model(tmp_path)
    tokens = prompt(BS + 9, 2)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()
    assert_close_rel(_logits(ours, tokens), ref)


def test_burst_computes_the_shared_prefix_once(family_models):
    """Three prompts sharing 40 tokens arrive together: the followers wait for the leader's
    checkpoint at 32 (KV and indexer pages, the GDN and PLE slots) and resume there."""
    path, _, hf = family_models(NAME)
    check_burst_computes_the_shared_prefix_once(path, hf)


def test_tensor_parallel_is_refused_by_name(family_models):
    path, _, _ = family_models(NAME)
    check_tensor_parallel_refused_by_name(path, "Qwen4ExpForCausalLM")
