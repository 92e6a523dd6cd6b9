"""The tiny checkpoints' recurrent paths move their logits by more than 1%, so a wrong state cannot
hide inside the family checks' tolerances (1e-4 relative). Mamba1 / Mamba2 families: the scans
dropped by hand (y = D x, gated as the mixer gates it); the others (GDN, KDA, lightning, RG-LRU,
RWKV's WKV num / den / max, Zaya's delayed values):
the slot's state zeroed after 32 of 53 prompt tokens. Models come from the shared session cache."""
import pytest
import torch
import torch.nn.functional as F

from hybridkv.kernels import ops
from family_checks import prompt
from model_harness import Harness

MAMBA = ("zamba2", "bamba", "granitemoehybrid", "nemotron_h", "falcon_h1", "mamba2", "mamba",
         "falcon_mamba", "jamba", "zamba")
STATE = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "recurrent_gemma", "olmo_hybrid", "minimax",
         "kimi_linear", "bailing_hybrid", "lara_mini", "rwkv", "zaya", "glm5_next", "qwen4_exp")


def _moved(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


def _skip_mamba2(ssm_state, x, dt, A, B, C, D, *args, **kwargs):
    return x * D.view(1, -1, 1).to(x.dtype)


def _skip_mamba1(ssm_state, x, dt, A, B, C, D, z, *args, **kwargs):
    y = x * D.to(x.dtype)
    return y if z is None else y * F.silu(z)


def _prompt_logits(model, tokens):
    h = Harness(model)
    return h.step([(h.add(tokens), len(tokens))], return_all_logits=True)


@pytest.mark.parametrize("name", MAMBA)
def test_dropping_the_scans_moves_the_logits(name, family_models, monkeypatch):
    _, ours, _ = family_models(name)
    tokens = prompt(53, 0)
    ref = _prompt_logits(ours, tokens)
    monkeypatch.setattr(ops, "mamba2_chunk_scan", _skip_mamba2)  # the models call ops.<name> at each step
    monkeypatch.setattr(ops, "mamba1_scan", _skip_mamba1)
    assert _moved(_prompt_logits(ours, tokens), ref) > 0.01


@pytest.mark.parametrize("name", STATE)
def test_a_zeroed_state_moves_the_logits(name, family_models):
    _, ours, _ = family_models(name)
    tokens = prompt(53, 0)
    runs = []
    for reset in (False, True):
        h = Harness(ours)
        seq = h.add(tokens)
        h.step([(seq, 32)])
        if reset:
            for pool in h.caches.state.values():
                pool[seq.slot].zero_()
        runs.append(h.step([(seq, 21)], return_all_logits=True))
    assert _moved(runs[1], runs[0]) > 0.01
