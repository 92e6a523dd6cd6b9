"""Kimi delta attention over state slots: the torch reference against transformers' KimiLinear torch
functions (chunked and recurrent), and the Triton step kernel against the reference."""
import pytest
import torch
import torch.nn.functional as F
from transformers.models.kimi_linear import modeling_kimi_linear as kl

from delta_rule_checks import (DeltaRule, check_decode_step_matches_transformers,
                               check_decode_steps_continue_a_prefill,
                               check_one_pass_and_pieces_match_transformers,
                               check_public_step_runs_both_backends,
                               check_return_states_at_equals_prefix_state,
                               check_varlen_from_slot_states_matches_transformers)
from hybridkv.kernels.kda_ref import kda_chunk_scan_ref, kda_state_update_ref
from state_kernel_helpers import qsl, rel_err, shuffled_slots, torch_path, untouched

H, K, V, SLOTS = 3, 8, 6, 7


def _inputs(gen, T, k_dim=K, v_dim=V):
    q = torch.randn(T, H, k_dim, generator=gen)
    k = torch.randn(T, H, k_dim, generator=gen)
    v = torch.randn(T, H, v_dim, generator=gen)
    # per-channel log-decay as KimiLinearForgetGate computes it: -exp(A_log) * softplus(.)
    A_log = torch.randn(1, H, 1, generator=gen) * 0.5
    g = -A_log.exp() * F.softplus(torch.randn(T, H, k_dim, generator=gen) - 1.0)
    beta = torch.randn(T, H, generator=gen).sigmoid()
    return q, k, v, g, beta


KDA = DeltaRule(_inputs, torch_path(kl.chunk_kimi_delta_attention),
                torch_path(kl.recurrent_kimi_delta_attention), kda_chunk_scan_ref,
                kda_state_update_ref, (H, K, V), SLOTS)


@pytest.mark.parametrize("chunk_size", [4, 16])
def test_one_pass_and_pieces_match_transformers(chunk_size):
    check_one_pass_and_pieces_match_transformers(KDA, chunk_size)


def test_varlen_from_slot_states_matches_transformers():
    check_varlen_from_slot_states_matches_transformers(KDA)


def test_return_states_at_equals_prefix_state():
    check_return_states_at_equals_prefix_state(KDA)


def test_decode_step_matches_transformers():
    check_decode_step_matches_transformers(KDA, requests=4)


def test_decode_steps_continue_a_prefill():
    check_decode_steps_continue_a_prefill(KDA)


def test_bad_shapes_are_refused_and_change_nothing():
    gen = torch.Generator().manual_seed(5)
    q, k, v, g, beta = _inputs(gen, 2)
    pool = torch.randn(SLOTS, H, K, V, generator=gen)
    before = pool.clone()
    slots = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"g \(2, 3\)"):
        kda_state_update_ref(pool, q, k, v, g[..., 0], beta, slots)  # a per-head gate is GDN's
    with pytest.raises(ValueError, match="chunk_size must be positive, got 0"):
        kda_chunk_scan_ref(pool, q, k, v, g, beta, qsl([2]), slots[:1], torch.tensor([True]),
                           chunk_size=0)
    assert torch.equal(pool, before)


# ---- Triton step kernel against the reference (TRITON_INTERPRET=1 on CPU) ----

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.mark.slow  # interpreted Triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("l2norm", [True, False])
def test_triton_step_matches_reference(dtype, l2norm):
    from hybridkv.kernels.kda import kda_state_update_triton

    gen = torch.Generator().manual_seed(40)
    k_dim, v_dim = 12, 20  # not powers of two: the masks matter
    q, k, v, g, beta = _inputs(gen, 5, k_dim, v_dim)
    if not l2norm:
        k = k * 0.3
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    pool = torch.randn(SLOTS, H, k_dim, v_dim, generator=gen)  # fp32 states beside fp16 inputs
    before, ref_pool = pool.clone(), pool.clone()
    slots = shuffled_slots(5, SLOTS, gen)
    scale = None if l2norm else 0.2
    want = kda_state_update_ref(ref_pool, q, k, v, g, beta, slots, scale, l2norm)
    got = kda_state_update_triton(pool, q, k, v, g, beta, slots, scale, l2norm)
    assert got.dtype == dtype
    assert rel_err(got, want) < TOL[dtype] and rel_err(pool, ref_pool) < TOL[dtype]
    assert untouched(before, pool, slots)


@pytest.mark.slow  # interpreted Triton
def test_public_api_runs_both_backends(monkeypatch):
    import hybridkv.kernels as hk

    check_public_step_runs_both_backends(monkeypatch, KDA, hk.kda_state_update, tol=1e-5)
