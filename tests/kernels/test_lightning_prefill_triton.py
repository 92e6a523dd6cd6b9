"""Triton varlen chunked lightning attention (kernels/lightning_prefill.py) against the torch
reference, interpreted on CPU."""
import pytest
import torch

from hybridkv.kernels.lightning_prefill import lightning_chunk_scan_triton
from hybridkv.kernels.lightning_ref import lightning_chunk_scan_ref
from chunk_scan_checks import (check_public_api_dispatches_to_triton, check_ragged_requests,
                               check_refused_and_unchanged, check_return_states_at,
                               check_two_calls_equal_one_call)
from state_kernel_helpers import qsl, rel_err

H, K, V, SLOTS, CS = 2, 6, 5, 9, 8
TOL = {torch.float32: 2e-5, torch.float16: 5e-3}


def _case(gen, lengths, dtype):
    T = sum(lengths)
    q, k, v = (torch.randn(T, H, d, generator=gen) for d in (K, K, V))
    # one gentle MiniMax-like decay rate and one strong one (padded rows must not overflow)
    slope = torch.tensor([0.05, 3.0]) * torch.rand(H, generator=gen).add(0.5)
    return [t.to(dtype) for t in (q, k, v)] + [slope]


def _both(pool, args, lengths, slots, init, **kw):
    ref_pool = pool.clone()
    common = (qsl(lengths), slots, torch.tensor(init), CS)
    got = lightning_chunk_scan_triton(pool, *args, *common, **kw)
    want = lightning_chunk_scan_ref(ref_pool, *args, *common, **kw)
    return got, want, ref_pool


@pytest.mark.slow  # interpreted Triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ragged_requests_match_reference(dtype):
    check_ragged_requests(_both, _case, (SLOTS, H, K, V), [1, CS - 1, CS, CS + 1, 2 * CS + 3, 0],
                          [True, False, True, True, False, False], dtype, TOL[dtype])


@pytest.mark.slow  # interpreted Triton
def test_half_pool_matches_reference():
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 13]
    args = _case(gen, lengths, torch.float32)
    pool = torch.randn(SLOTS, H, K, V, generator=gen).half()
    slots = torch.tensor([4, 2], dtype=torch.int32)
    got, want, ref_pool = _both(pool, args, lengths, slots, [True, True])
    assert rel_err(got, want) < 1e-3 and rel_err(pool, ref_pool) < 1e-3


@pytest.mark.slow  # interpreted Triton
def test_two_calls_equal_one_call():
    check_two_calls_equal_one_call(
        lambda pool, args, starts, slots, init: lightning_chunk_scan_triton(
            pool, *args, starts, slots, init, chunk_size=CS), _case, (SLOTS, H, K, V))


@pytest.mark.slow  # interpreted Triton
def test_return_states_at_match_reference():
    check_return_states_at(_both, _case, (SLOTS, H, K, V), CS)


@pytest.mark.parametrize("bad", ["slope", "slot", "position"])
def test_bad_input_raises_and_changes_nothing(bad):
    match = {"slope": "slope has shape \\(1,\\)", "slot": f"slot index {SLOTS}",
             "position": "position 5 of request 0 is outside 1..4"}[bad]
    check_refused_and_unchanged(
        lambda pool, args, *rest, **kw: lightning_chunk_scan_triton(pool, *args, *rest,
                                                                    chunk_size=CS, **kw),
        _case, (SLOTS, H, K, V), match,
        spoil=(lambda a: a[:3] + [a[3][:1]]) if bad == "slope" else None,
        slot=SLOTS if bad == "slot" else 2,
        return_states_at=[[5]] if bad == "position" else None)


@pytest.mark.slow  # interpreted Triton
def test_public_api_dispatches_to_triton(monkeypatch):
    import hybridkv.kernels.lightning_prefill as lp

    check_public_api_dispatches_to_triton(monkeypatch, lp, "lightning_chunk_scan_triton",
                                          "lightning_chunk_scan", _case, (SLOTS, H, K, V), [3, 9],
                                          chunk_size=CS)


@pytest.mark.slow  # interpreted Triton
def test_several_value_blocks():
    """V = 70: three V blocks of 32 per head (K = 20 pads to a 32-wide key tile)."""
    gen = torch.Generator().manual_seed(6)
    kd, vd = 20, 70
    lengths = [CS + 1, 3]
    T = sum(lengths)
    q, k, v = (torch.randn(T, 1, d, generator=gen) for d in (kd, kd, vd))
    slope = torch.rand(1, generator=gen) * 0.5
    pool = torch.randn(4, 1, kd, vd, generator=gen)
    ref_pool = pool.clone()
    common = (qsl(lengths), torch.tensor([3, 1], dtype=torch.int32), torch.tensor([True, False]),
              CS)
    got = lightning_chunk_scan_triton(pool, q, k, v, slope, *common)
    want = lightning_chunk_scan_ref(ref_pool, q, k, v, slope, *common)
    assert rel_err(got, want) < 2e-5 and rel_err(pool, ref_pool) < 2e-5


@pytest.mark.slow  # interpreted Triton
def test_chunk_size_above_the_tile_cap():
    """K = 130 pads to a 256-wide key tile, where the kernel cuts chunks at 16 tokens (exact at any
    cut); the reference cuts at 24."""
    gen = torch.Generator().manual_seed(7)
    kd, lengths = 130, [30, 3]
    T = sum(lengths)
    q, k = (torch.randn(T, 1, kd, generator=gen) * 0.2 for _ in range(2))
    v = torch.randn(T, 1, V, generator=gen)
    slope = torch.tensor([0.1])
    pool = torch.randn(4, 1, kd, V, generator=gen)
    ref_pool = pool.clone()
    common = (qsl(lengths), torch.tensor([3, 1], dtype=torch.int32), torch.tensor([True, False]))
    got = lightning_chunk_scan_triton(pool, q, k, v, slope, *common, chunk_size=24)
    want = lightning_chunk_scan_ref(ref_pool, q, k, v, slope, *common, chunk_size=24)
    assert rel_err(got, want) < 2e-5 and rel_err(pool, ref_pool) < 2e-5
