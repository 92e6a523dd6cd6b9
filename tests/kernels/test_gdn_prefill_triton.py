"""Triton varlen chunked gated delta rule (kernels/gdn_prefill.py) against the torch reference,
interpreted on CPU."""
import pytest
import torch
import torch.nn.functional as F

from hybridkv.kernels.gdn_prefill import gdn_chunk_scan_triton
from hybridkv.kernels.gdn_ref import gdn_chunk_scan_ref
from chunk_scan_checks import (check_public_api_dispatches_to_triton, check_ragged_requests,
                               check_refused_and_unchanged, check_return_states_at,
                               check_two_calls_equal_one_call)
from state_kernel_helpers import qsl, rel_err

H, HV, K, V, SLOTS, CS = 1, 2, 6, 5, 9, 8
TOL = {torch.float32: 2e-5, torch.float16: 5e-3}


def _case(gen, lengths, dtype):
    T = sum(lengths)
    q, k = torch.randn(T, H, K, generator=gen), torch.randn(T, H, K, generator=gen)
    v = torch.randn(T, HV, V, generator=gen)
    A_log = torch.randn(HV, generator=gen) * 0.5  # log-decay as Qwen3NextGatedDeltaNet makes it
    g = -A_log.exp() * F.softplus(torch.randn(T, HV, generator=gen) + 0.5)
    beta = torch.randn(T, HV, generator=gen).sigmoid()
    return [t.to(dtype) for t in (q, k, v)] + [g, beta]


def _both(pool, args, lengths, slots, init, l2norm=True, **kw):
    ref_pool = pool.clone()
    common = (qsl(lengths), slots, torch.tensor(init), None, l2norm, CS)
    got = gdn_chunk_scan_triton(pool, *args, *common, **kw)
    want = gdn_chunk_scan_ref(ref_pool, *args, *common, **kw)
    return got, want, ref_pool


@pytest.mark.slow  # interpreted Triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ragged_requests_match_reference(dtype):
    check_ragged_requests(_both, _case, (SLOTS, HV, K, V), [1, CS - 1, CS, CS + 1, 2 * CS + 3, 0],
                          [True, False, True, True, False, False], dtype, TOL[dtype])


@pytest.mark.slow  # interpreted Triton
def test_without_l2norm_and_with_a_half_pool():
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 13]
    q, k, v, g, beta = _case(gen, lengths, torch.float32)
    q, k = q * 0.3, k * 0.3  # unnormalised keys: keep the delta rule stable
    pool = torch.randn(SLOTS, HV, K, V, generator=gen).half()
    slots = torch.tensor([4, 2], dtype=torch.int32)
    got, want, ref_pool = _both(pool, (q, k, v, g, beta), lengths, slots, [True, True],
                                l2norm=False)
    assert rel_err(got, want) < 1e-3 and rel_err(pool, ref_pool) < 1e-3


@pytest.mark.slow  # interpreted Triton
def test_two_calls_equal_one_call():
    check_two_calls_equal_one_call(
        lambda pool, args, starts, slots, init: gdn_chunk_scan_triton(
            pool, *args, starts, slots, init, chunk_size=CS), _case, (SLOTS, HV, K, V))


@pytest.mark.slow  # interpreted Triton
def test_return_states_at_match_reference():
    check_return_states_at(_both, _case, (SLOTS, HV, K, V), CS)


@pytest.mark.parametrize("bad", ["heads", "slot"])
def test_bad_input_raises_and_changes_nothing(bad):
    match = {"heads": "must be \\[S, 1, 6, 5\\]", "slot": f"slot index {SLOTS}"}[bad]
    one_value_head = lambda a: a[:2] + [t[:, :1] for t in a[2:]]  # v, g, beta  # noqa: E731
    check_refused_and_unchanged(
        lambda pool, args, *rest, **kw: gdn_chunk_scan_triton(pool, *args, *rest, chunk_size=CS),
        _case, (SLOTS, HV, K, V), match, spoil=one_value_head if bad == "heads" else None,
        slot=SLOTS if bad == "slot" else 2)


@pytest.mark.slow  # interpreted Triton
def test_public_api_dispatches_to_triton(monkeypatch):
    import hybridkv.kernels.gdn_prefill as gp

    check_public_api_dispatches_to_triton(monkeypatch, gp, "gdn_chunk_scan_triton",
                                          "gdn_chunk_scan", _case, (SLOTS, HV, K, V), [3, 9],
                                          chunk_size=CS)


@pytest.mark.slow  # interpreted Triton
def test_several_tiles_per_head():
    """K = V = 70: two column tiles in the WY prep and two V blocks in the recurrence."""
    gen = torch.Generator().manual_seed(6)
    kd = vd = 70
    lengths = [CS + 1, 3]
    T = sum(lengths)
    q, k = torch.randn(T, 1, kd, generator=gen), torch.randn(T, 1, kd, generator=gen)
    v = torch.randn(T, 2, vd, generator=gen)
    g = -F.softplus(torch.randn(T, 2, generator=gen))
    beta = torch.randn(T, 2, generator=gen).sigmoid()
    pool = torch.randn(4, 2, kd, vd, generator=gen)
    ref_pool = pool.clone()
    common = (qsl(lengths), torch.tensor([3, 1], dtype=torch.int32), torch.tensor([True, False]),
              None, True, CS)
    got = gdn_chunk_scan_triton(pool, q, k, v, g, beta, *common)
    want = gdn_chunk_scan_ref(ref_pool, q, k, v, g, beta, *common)
    assert rel_err(got, want) < 2e-5 and rel_err(pool, ref_pool) < 2e-5
