"""RWKV-4's own checks: the WKV op against transformers' recurrence, the planner's specs, the token
shifts mattering as much as the WKV state, other config options and bfloat16 against transformers,
and tensor parallelism refused by name. The shared checks are its row in tests/family_checks.py
(with the prefix hit and a migration to block size 8); the zero-KV engine checks (burst, slot
pressure, preemption in both modes, migration) run it in test_pure_recurrent.py; the zeroed WKV
state moving the logits is in test_recurrent_paths_matter.py."""
import pytest
import torch
from transformers.models.rwkv.modeling_rwkv import rwkv_linear_attention_cpu

from hybridkv.config_specs import load_specs, specs_from_config
from hybridkv.kernels import ops
from hybridkv.specs import RecurrentSpec

from family_checks import BS, check_tensor_parallel_refused_by_name, load_pair, prompt, tiny_rwkv
from model_harness import Harness, assert_close_rel, hf_logits

NAME = "rwkv"


def _moved(got, ref) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


def test_wkv_ops_equal_transformers_recurrence_across_chunks_and_slots():
    """Three requests (7, 1 and 12 tokens, keys up to +-30 so the running max matters) through
    rwkv4_scan in two calls and then one rwkv4_state_update each: every output and the final
    states equal transformers' rwkv_linear_attention_cpu over the whole sequences."""
    g = torch.Generator().manual_seed(0)
    C, lengths = 8, (7, 1, 12)
    decay, first = torch.randn(C, generator=g), torch.randn(C, generator=g)
    seqs = [(torch.randn(n + 1, C, generator=g) * 10, torch.randn(n + 1, C, generator=g)) for n in lengths]
    pool = torch.randn(6, 3, C, generator=g)  # garbage: fresh requests must not read it
    slots = torch.tensor([4, 1, 3], dtype=torch.int32)
    got = [[] for _ in seqs]
    cut = [3, 1, 5]  # first call: a prefix of each request (fresh state), second call: the rest
    for call, init in ((0, False), (1, True)):
        parts = [(k[:c], v[:c]) if call == 0 else (k[c:-1], v[c:-1]) for (k, v), c in zip(seqs, cut)]
        qsl = torch.tensor([0] + [sum(p[0].shape[0] for p in parts[:r + 1]) for r in range(3)], dtype=torch.int32)
        out = ops.rwkv4_scan(pool, torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                             decay, first, qsl, slots, torch.tensor([init] * 3))
        for r in range(3):
            got[r].append(out[qsl[r]:qsl[r + 1]])
    last = ops.rwkv4_state_update(pool, torch.stack([k[-1] for k, _ in seqs]),
                                  torch.stack([v[-1] for _, v in seqs]), decay, first, slots)
    for r, (k, v) in enumerate(seqs):
        want, (num, den, mx) = rwkv_linear_attention_cpu(decay, first, k[None], v[None], return_state=True)
        torch.testing.assert_close(torch.cat(got[r] + [last[r:r + 1]]), want[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(pool[slots[r]], torch.cat([num, den, mx]), rtol=1e-6, atol=1e-6)


def test_planner_specs_equal_the_model_and_keep_five_tensors(family_models):
    path, ours, _ = family_models(NAME)
    specs = ours.cache_specs()
    assert load_specs(path / "config.json", torch.float32) == specs
    assert set(specs.values()) == {RecurrentSpec((2, 64), (3, 64), torch.float32)}  # shifts | num, den, max


def test_class_default_config_plans_by_hand():
    """transformers' defaults (no published config is available offline): 32 layers of hidden
    4096; per layer 2 x 4096 bf16 shifts and 3 x 4096 float32 WKV values: 4 MiB a request."""
    from hybridkv.plan import state_bytes_per_slot

    specs = specs_from_config({"model_type": NAME}, torch.bfloat16)
    assert set(specs) == set(range(32))
    assert set(specs.values()) == {RecurrentSpec((2, 4096), (3, 4096), torch.bfloat16, torch.float32)}
    assert state_bytes_per_slot(specs) == 32 * (2 * 4096 * 2 + 3 * 4096 * 4)


def test_zeroed_token_shifts_move_the_logits(family_models):
    """The shifts (the slot's window part) matter as much as the WKV state: zeroed after 32 of 53
    tokens, the next 21 tokens' logits move by more than 1%."""
    _, ours, _ = family_models(NAME)
    tokens = prompt(53, 0)
    runs = []
    for reset in (False, True):
        h = Harness(ours)
        seq = h.add(tokens)
        h.step([(seq, 32)])
        if reset:
            for pool in h.caches.conv.values():
                pool[seq.slot].zero_()
        runs.append(h.step([(seq, 21)], return_all_logits=True))
    assert _moved(runs[1], runs[0]) > 0.01


@pytest.mark.parametrize("overrides", [dict(rescale_every=0),
                                       dict(rescale_every=1, attention_hidden_size=32, intermediate_size=96,
                                            tie_word_embeddings=True)])
def test_other_options_match_transformers(overrides, tmp_path):
    """No rescaling; rescaling after every block with a narrower WKV and tied embeddings."""
    ours, hf = load_pair(tiny_rwkv(NAME, tmp_path, seed=4, **overrides))
    tokens = prompt(2 * BS + 3, 1)
    h = Harness(ours)
    seq = h.add(tokens)
    got = torch.cat([h.step([(seq, 20)], return_all_logits=True), h.step([(seq, 15)], return_all_logits=True)])
    assert_close_rel(got, hf_logits(hf, tokens))


def test_bfloat16_keeps_float32_where_transformers_does(family_models):
    """In bfloat16, time_decay / time_first and the WKV state stay float32 (the shifts are
    bfloat16), and the logits follow transformers' bfloat16 model within bfloat16's precision."""
    from transformers import AutoModelForCausalLM

    from hybridkv.models import load_model

    path, _, _ = family_models(NAME)
    ours = load_model(path, dtype=torch.bfloat16)
    att = ours.rwkv.blocks[1].attention
    assert att.time_decay.dtype == att.time_first.dtype == torch.float32
    assert att.key.weight.dtype == torch.bfloat16
    assert set(ours.cache_specs().values()) == {RecurrentSpec((2, 64), (3, 64), torch.bfloat16, torch.float32)}
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    tokens = prompt(BS + 5, 2)
    h = Harness(ours)
    got = h.step([(h.add(tokens), len(tokens))], return_all_logits=True)
    assert_close_rel(got, hf_logits(hf, tokens), rtol=3e-2)


def test_tensor_parallel_is_refused_by_name(family_models):
    path, _, _ = family_models(NAME)
    check_tensor_parallel_refused_by_name(path, "RwkvForCausalLM")
