"""GraniteMoeHybrid's own checks (specs, a dense no-rope variant); the shared ones are its row in
test_families.py."""
import torch

from family_checks import BS, check_prompt_logits, load_pair
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.specs import AttentionSpec, RecurrentSpec


def test_cache_specs(family_models):
    _, ours, _ = family_models("granitemoehybrid")
    specs = ours.cache_specs()
    assert sorted(specs) == [0, 1, 2, 3]
    # conv window [d_inner + 2 * groups * d_state, k - 1]; state [H, P, N]
    assert specs[0] == specs[2] == RecurrentSpec((128 + 2 * 2 * 16, 3), (8, 16, 16), torch.float32)
    assert specs[1] == specs[3] == AttentionSpec(2, 16, torch.float32)


def test_dense_nope_tied_variant_logits(tmp_path):
    """No MoE (shared MLP only), no rope, tied embeddings, other multipliers, mamba first and last."""
    path = make_tiny_checkpoint("granitemoehybrid", tmp_path, seed=4, num_local_experts=0,
                                position_embedding_type=None, tie_word_embeddings=True,
                                layer_types=["mamba", "attention", "mamba"], num_hidden_layers=3,
                                embedding_multiplier=2.0, attention_multiplier=0.3,
                                residual_multiplier=0.9, logits_scaling=0.7)
    ours, hf = load_pair(path)
    assert ours.rotary is None and all(layer.block_sparse_moe is None for layer in ours.model.layers)
    check_prompt_logits(ours, hf, n=2 * BS + 3, seed=1)
