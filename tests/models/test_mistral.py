"""Mistral's own checks (the window in its specs, that the window changes the outputs, blocks let
go once they leave the window, a config without a window); the shared ones are its row in
test_families.py."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig

from family_checks import BS, WINDOW, check_prompt_logits, load_pair, prompt
from hybridkv.config_specs import specs_from_config
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.specs import AttentionSpec
from model_harness import Harness, assert_close_rel, assert_greedy_matches_hf, hf_logits


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


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])  # Triton runs interpreted on CPU
def test_blocks_let_go_outside_the_window_may_be_reused(family_models, backend, monkeypatch):
    """As the memory manager will do: after every step, the blocks wholly before the window of
    each request's next token leave its block table (-1), are filled with NaN and go to the front
    of the free list, where the other request takes them and writes its own KV in part of them.
    Every token is still transformers'."""
    monkeypatch.setenv("HYBRIDKV_BACKEND", backend)
    _, ours, hf = family_models("mistral")
    h = Harness(ours)
    prompts = [prompt(3 * WINDOW + 5, 7), prompt(5, 8)]
    long, short = seqs = [h.add(p) for p in prompts]
    let_go = []

    def let_go_outside_the_window():
        for s in seqs:
            first = max(0, s.num_computed - WINDOW + 1) // BS  # the next token sees keys > p - WINDOW
            for i in range(first):
                if s.blocks[i] >= 0:
                    let_go.append(s.blocks[i])
                    for kv in h.caches.kv.values():
                        kv[s.blocks[i]] = float("nan")
                    h.free_blocks.append(s.blocks[i])  # popped next
                    s.blocks[i] = -1

    while long.num_computed < len(long.tokens):  # prefill in chunks of 20, the short one rides along
        work = [(s, min(20, len(s.tokens) - s.num_computed)) for s in seqs if s.num_computed < len(s.tokens)]
        h.step(work)
        let_go_outside_the_window()
    generated = [[], []]
    for step in range(20):
        for s, out in zip(seqs, generated):
            out.append(int(s.last_logits.argmax()))
            s.tokens.append(out[-1])
        h.step([(s, 1) for s in seqs])
        let_go_outside_the_window()
    assert len(let_go) >= 4 and set(let_go) & set(short.blocks)  # the short request reused some
    for p, g in zip(prompts, generated):
        assert assert_greedy_matches_hf(hf, p, g) == 0


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
