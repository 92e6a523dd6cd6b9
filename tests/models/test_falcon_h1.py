"""Falcon-H1's own checks (two cache keys per layer, muP multipliers, variants, a prefix hit);
the shared ones are its row in test_families.py."""
import json
import shutil

import torch

from family_checks import BS, check_prompt_logits, check_ragged_batch_greedy, load_pair
from hybridkv.models import load_model
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.specs import AttentionSpec, RecurrentSpec
from model_harness import Harness, assert_greedy_matches_hf


def test_cache_specs_two_keys_per_layer(family_models):
    _, ours, _ = family_models("falcon_h1")
    specs = ours.cache_specs()
    # attention half of layer i under key i, Mamba half under num_hidden_layers + i
    assert sorted(specs) == list(range(6))
    for i in range(3):
        assert specs[i] == AttentionSpec(2, 16, torch.float32)
        # conv window [d_ssm + 2 * groups * d_state, k - 1]; state [H, P, N]
        assert specs[3 + i] == RecurrentSpec((96 + 2 * 2 * 16, 3), (6, 16, 16), torch.float32)


def test_multipliers_matter(family_models, tmp_path):
    """The same weights under a config with every multiplier at 1 give other logits: the
    oracle comparison in test_families.py does exercise the multipliers."""
    tiny_path, ours, _ = family_models("falcon_h1")
    plain_dir = tmp_path / "plain"
    shutil.copytree(tiny_path, plain_dir)
    cfg = json.loads((plain_dir / "config.json").read_text())
    for k in ("embedding_multiplier", "attention_in_multiplier", "attention_out_multiplier",
              "key_multiplier", "ssm_in_multiplier", "ssm_out_multiplier", "lm_head_multiplier"):
        cfg[k] = 1.0
    cfg["ssm_multipliers"], cfg["mlp_multipliers"] = [1.0] * 5, [1.0, 1.0]
    (plain_dir / "config.json").write_text(json.dumps(cfg))
    plain = load_model(plain_dir)
    tokens = list(range(4, 4 + BS + 3))
    a, b = Harness(ours), Harness(plain)
    la = a.step([(a.add(tokens), len(tokens))], return_all_logits=True)
    lb = b.step([(b.add(tokens), len(tokens))], return_all_logits=True)
    assert (la - lb).abs().max() > 1e-2 * la.abs().max()


def test_ungated_norm_bias_tied_variant_logits(tmp_path):
    """No gated RMSNorm in the mixer (y * silu(z)), norm after the gate unused, projector and
    in_proj biases, attention biases, tied embeddings, two layers."""
    path = make_tiny_checkpoint("falcon_h1", tmp_path, seed=6, mamba_rms_norm=False,
                                projectors_bias=True, mamba_proj_bias=True, attention_bias=True,
                                tie_word_embeddings=True, num_hidden_layers=2)
    ours, hf = load_pair(path)
    assert all(layer.mamba.norm is None for layer in ours.model.layers)
    assert ours.model.layers[0].mamba.out_proj.bias is not None
    check_prompt_logits(ours, hf, n=2 * BS + 3, seed=1)
    check_ragged_batch_greedy(ours, hf, lengths=(1, BS + 1), steps=6)


def test_norm_after_gate_variant_logits(tmp_path):
    """mamba_norm_before_gate=False: norm(y * silu(z)) * w."""
    path = make_tiny_checkpoint("falcon_h1", tmp_path, seed=7, mamba_norm_before_gate=False,
                                num_hidden_layers=2)
    check_prompt_logits(*load_pair(path), n=BS + 5, seed=2)


def test_engine_prefix_hit_restores_kv_and_state(family_models):
    """A second prompt sharing a 40-token prefix hits 32 cached tokens (KV blocks of every
    attention half plus a state checkpoint of every Mamba half) and still decodes as transformers."""
    from engine_fixtures import assert_no_leaks
    from hybridkv import LLM, SamplingParams

    tiny_path, _, hf = family_models("falcon_h1")
    llm = LLM(str(tiny_path), memory_budget_bytes=16 << 20)
    base = list(range(10, 50))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm.generate([base + [5, 6, 7]], params, use_tqdm=False)
    out = llm.generate([base + [9, 10]], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 2 * BS
    assert assert_greedy_matches_hf(hf, base + [9, 10], list(out.outputs[0].token_ids)) == 0
    assert_no_leaks(llm)
