"""LFM2's own checks (conv-only state, biases); the shared ones are its row in test_families.py."""
import torch

from family_checks import BS, load_pair, prompt
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.specs import AttentionSpec, RecurrentSpec
from model_harness import Harness, assert_close_rel, hf_logits


def test_cache_specs(family_models):
    _, ours, hf = family_models("lfm2")
    specs = ours.cache_specs()
    # conv layers keep only the window of the last k-1 gated inputs: no SSM state
    assert specs[0] == specs[1] == specs[3] == RecurrentSpec((64, 2), (), torch.float32)
    assert specs[2] == AttentionSpec(2, 16, torch.float32)
    # the feed-forward width follows transformers' block_auto_adjust_ff_dim rounding
    assert ours.model.layers[0].feed_forward.gate_proj.weight.shape == \
        hf.model.layers[0].feed_forward.w1.weight.shape == (128, 64)


def test_biases_and_untied_head(tmp_path):
    # conv_bias switches on the conv, in_proj and out_proj biases together
    path = make_tiny_checkpoint("lfm2", tmp_path, seed=4, conv_bias=True, tie_word_embeddings=False,
                                layer_types=["full_attention", "conv"], num_hidden_layers=2)
    ours, hf = load_pair(path)
    assert ours.model.layers[1].conv.conv.bias is not None
    assert not torch.equal(ours.lm_head.weight, ours.model.embed_tokens.weight)
    h = Harness(ours, block_size=BS)
    tokens = prompt(BS + 3, 1)
    seq = h.add(tokens)
    logits = torch.cat([h.step([(seq, 11)], return_all_logits=True),
                        h.step([(seq, len(tokens) - 11)], return_all_logits=True)])
    assert_close_rel(logits, hf_logits(hf, tokens))
