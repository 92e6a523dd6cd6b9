"""Gated delta rule over state slots: the torch reference against transformers' Qwen3-Next torch
functions, and the Triton step kernel against the reference."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as qn

from delta_rule_checks import (DeltaRule, check_decode_step_matches_transformers,
                               check_decode_steps_continue_a_prefill,
                               check_one_pass_and_pieces_match_transformers,
                               check_public_step_runs_both_backends,
                               check_return_states_at_equals_prefix_state,
                               check_varlen_from_slot_states_matches_transformers)
from hybridkv.kernels.gdn_ref import gdn_chunk_scan_ref, gdn_state_update_ref
from state_kernel_helpers import rel_err, shuffled_slots, torch_path, untouched

H, HV, K, V, SLOTS = 2, 4, 8, 6, 7


def _inputs(gen, T, hq=H, hv=HV):
    q = torch.randn(T, hq, K, generator=gen)
    k = torch.randn(T, hq, K, generator=gen)
    v = torch.randn(T, hv, V, generator=gen)
    # log-decay and write strength computed the way Qwen3NextGatedDeltaNet does
    A_log = torch.randn(hv, generator=gen) * 0.5
    g = -A_log.exp() * F.softplus(torch.randn(T, hv, generator=gen) + 0.5)
    beta = torch.randn(T, hv, generator=gen).sigmoid()
    return q, k, v, g, beta


GDN = DeltaRule(_inputs, torch_path(qn.torch_chunk_gated_delta_rule),
                torch_path(qn.torch_recurrent_gated_delta_rule), gdn_chunk_scan_ref,
                gdn_state_update_ref, (HV, K, V), SLOTS)
# as many value heads as query / key heads (no GQA-style sharing)
GDN_UNSHARED = dataclasses.replace(GDN, inputs=lambda gen, T: _inputs(gen, T, hq=3, hv=3),
                                   state_shape=(3, K, V))


@pytest.mark.parametrize("chunk_size", [4, 16])
def test_one_pass_and_chunked_match_transformers(chunk_size):
    check_one_pass_and_pieces_match_transformers(GDN, chunk_size)


def test_varlen_from_slot_states_matches_transformers():
    check_varlen_from_slot_states_matches_transformers(GDN)


def test_return_states_at_equals_prefix_state():
    check_return_states_at_equals_prefix_state(GDN)


def test_decode_step_matches_transformers():
    check_decode_step_matches_transformers(GDN, requests=3)


def test_decode_steps_continue_a_prefill():
    check_decode_steps_continue_a_prefill(GDN_UNSHARED)


# ---- Triton step kernel against the reference (TRITON_INTERPRET=1 on CPU) ----

TOL = {torch.float32: 1e-4, torch.float16: 2e-3}


@pytest.mark.slow  # interpreted Triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("l2norm", [True, False])
def test_triton_step_matches_reference(dtype, l2norm):
    from hybridkv.kernels.gdn import gdn_state_update_triton

    gen = torch.Generator().manual_seed(40)
    k_dim, v_dim = 12, 20  # not powers of two: the masks matter
    q = torch.randn(5, H, k_dim, generator=gen).to(dtype)
    k = (torch.randn(5, H, k_dim, generator=gen) * (1.0 if l2norm else 0.3)).to(dtype)
    v = torch.randn(5, HV, v_dim, generator=gen).to(dtype)
    g = (-F.softplus(torch.randn(5, HV, generator=gen))).to(dtype)
    beta = torch.randn(5, HV, generator=gen).sigmoid().to(dtype)
    pool = torch.randn(SLOTS, HV, k_dim, v_dim, generator=gen)  # fp32 states beside fp16 inputs
    before, ref_pool = pool.clone(), pool.clone()
    slots = shuffled_slots(5, SLOTS, gen)
    scale = None if l2norm else 0.2
    want = gdn_state_update_ref(ref_pool, q, k, v, g, beta, slots, scale, l2norm)
    got = gdn_state_update_triton(pool, q, k, v, g, beta, slots, scale, l2norm)
    assert got.dtype == dtype
    assert rel_err(got, want) < TOL[dtype] and rel_err(pool, ref_pool) < TOL[dtype]
    assert untouched(before, pool, slots)


@pytest.mark.slow  # interpreted Triton
def test_public_api_runs_both_backends(monkeypatch):
    import hybridkv.kernels as hk

    check_public_step_runs_both_backends(monkeypatch, GDN, hk.gdn_state_update, tol=1e-4)
