"""Triton varlen chunked Kimi delta attention (kernels/kda_prefill.py) against the torch reference,
interpreted on CPU."""
import pytest
import torch
import torch.nn.functional as F

from hybridkv.kernels.kda_prefill import kda_chunk_scan_triton
from hybridkv.kernels.kda_ref import kda_chunk_scan_ref
from chunk_scan_checks import (check_public_api_dispatches_to_triton, check_ragged_requests,
                               check_refused_and_unchanged, check_return_states_at,
                               check_two_calls_equal_one_call)
from state_kernel_helpers import qsl, rel_err

H, K, V, SLOTS, CS = 2, 6, 5, 9, 8
TOL = {torch.float32: 2e-5, torch.float16: 5e-3}


def _case(gen, lengths, dtype, strong=False):
    T = sum(lengths)
    q, k, v = (torch.randn(T, H, d, generator=gen) for d in (K, K, V))
    # per-channel log-decay as Kimi-Linear makes it: -exp(A_log) * softplus(f(x) + dt_bias)
    A_log = torch.randn(H, K, generator=gen) * 0.5 + (3.0 if strong else 0.0)
    g = -A_log.exp() * F.softplus(torch.randn(T, H, K, generator=gen) + 0.5)
    beta = torch.randn(T, H, generator=gen).sigmoid()
    return [t.to(dtype) for t in (q, k, v)] + [g, beta]


def _both(pool, args, lengths, slots, init, l2norm=True, **kw):
    ref_pool = pool.clone()
    common = (qsl(lengths), slots, torch.tensor(init), None, l2norm, CS)
    got = kda_chunk_scan_triton(pool, *args, *common, **kw)
    want = kda_chunk_scan_ref(ref_pool, *args, *common, **kw)
    return got, want, ref_pool


@pytest.mark.slow  # interpreted Triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ragged_requests_match_reference(dtype):
    check_ragged_requests(_both, _case, (SLOTS, H, K, V), [1, CS - 1, CS, CS + 1, 2 * CS + 3, 0],
                          [True, False, True, True, False, False], dtype, TOL[dtype])


@pytest.mark.slow  # interpreted Triton
def test_strong_decay_without_l2norm_and_a_half_pool():
    """~20 nats of decay per token on some channels: e^-G would overflow fp32 within a chunk."""
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 13]
    q, k, v, g, beta = _case(gen, lengths, torch.float32, strong=True)
    assert g.min() < -15
    q, k = q * 0.3, k * 0.3  # unnormalised keys: keep the delta rule stable
    pool = torch.randn(SLOTS, H, K, V, generator=gen).half()
    slots = torch.tensor([4, 2], dtype=torch.int32)
    got, want, ref_pool = _both(pool, (q, k, v, g, beta), lengths, slots, [True, True],
                                l2norm=False)
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < 1e-3 and rel_err(pool, ref_pool) < 1e-3


@pytest.mark.slow  # interpreted Triton
def test_two_calls_equal_one_call():
    check_two_calls_equal_one_call(
        lambda pool, args, starts, slots, init: kda_chunk_scan_triton(
            pool, *args, starts, slots, init, chunk_size=CS), _case, (SLOTS, H, K, V))


@pytest.mark.slow  # interpreted Triton
def test_return_states_at_match_reference():
    check_return_states_at(_both, _case, (SLOTS, H, K, V), CS)


@pytest.mark.parametrize("bad", ["gate", "slot"])
def test_bad_input_raises_and_changes_nothing(bad):
    match = {"gate": "g \\(4, 2, 1\\)", "slot": f"slot index {SLOTS}"}[bad]
    # one gate per head (GDN's layout), not one per key channel
    per_head_gate = lambda a: a[:3] + [a[3][..., :1], a[4]]  # noqa: E731
    check_refused_and_unchanged(
        lambda pool, args, *rest, **kw: kda_chunk_scan_triton(pool, *args, *rest, chunk_size=CS),
        _case, (SLOTS, H, K, V), match, spoil=per_head_gate if bad == "gate" else None,
        slot=SLOTS if bad == "slot" else 2)


@pytest.mark.slow  # interpreted Triton
def test_public_api_dispatches_to_triton(monkeypatch):
    import hybridkv.kernels.kda_prefill as kp

    check_public_api_dispatches_to_triton(monkeypatch, kp, "kda_chunk_scan_triton",
                                          "kda_chunk_scan", _case, (SLOTS, H, K, V), [3, 9],
                                          chunk_size=CS)


@pytest.mark.slow  # interpreted Triton
def test_several_value_blocks():
    """V = 70: three V blocks of 32 per head (K = 20 pads to a 32-wide key tile)."""
    gen = torch.Generator().manual_seed(6)
    kd, vd = 20, 70
    lengths = [CS + 1, 3]
    T = sum(lengths)
    q, k, v = (torch.randn(T, 1, d, generator=gen) for d in (kd, kd, vd))
    g = -F.softplus(torch.randn(T, 1, kd, generator=gen))
    beta = torch.randn(T, 1, generator=gen).sigmoid()
    pool = torch.randn(4, 1, kd, vd, generator=gen)
    ref_pool = pool.clone()
    common = (qsl(lengths), torch.tensor([3, 1], dtype=torch.int32), torch.tensor([True, False]),
              None, True, CS)
    got = kda_chunk_scan_triton(pool, q, k, v, g, beta, *common)
    want = kda_chunk_scan_ref(ref_pool, q, k, v, g, beta, *common)
    assert rel_err(got, want) < 2e-5 and rel_err(pool, ref_pool) < 2e-5


@pytest.mark.slow  # interpreted Triton
def test_chunk_size_above_the_tile_cap():
    """chunk_size 40: the kernel cuts at 16 (exact at any cut), the reference at 40."""
    gen = torch.Generator().manual_seed(7)
    lengths = [37, 20]
    args = _case(gen, lengths, torch.float32)
    pool = torch.randn(SLOTS, H, K, V, generator=gen)
    ref_pool = pool.clone()
    common = (qsl(lengths), torch.tensor([2, 5], dtype=torch.int32), torch.tensor([True, False]))
    got = kda_chunk_scan_triton(pool, *args, *common, chunk_size=40)
    want = kda_chunk_scan_ref(ref_pool, *args, *common, chunk_size=40)
    assert rel_err(got, want) < 2e-5 and rel_err(pool, ref_pool) < 2e-5
