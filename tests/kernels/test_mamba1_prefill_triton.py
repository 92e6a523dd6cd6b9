"""Triton varlen selective scan (kernels/mamba1_prefill.py) against the torch reference,
interpreted on CPU."""
import pytest
import torch

from hybridkv.kernels.mamba1_prefill import mamba1_scan_triton
from hybridkv.kernels.mamba1_ref import mamba1_scan_ref
from chunk_scan_checks import (assert_states_match, check_public_api_dispatches_to_triton,
                               check_ragged_requests, check_refused_and_unchanged, per_token_rows,
                               split_in_two)
from state_kernel_helpers import qsl, rel_err

D_IN, N, SLOTS = 10, 6, 9
TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


def _case(gen, lengths, dtype):
    T = sum(lengths)
    A = -torch.exp(torch.randn(D_IN, N, generator=gen) * 0.5)
    D = torch.randn(D_IN, generator=gen)
    dt_bias = torch.randn(D_IN, generator=gen) * 0.5
    x, dt, z = (torch.randn(T, D_IN, generator=gen) for _ in range(3))
    B, C = torch.randn(T, N, generator=gen), torch.randn(T, N, generator=gen)
    return [x.to(dtype), dt.to(dtype), A, B.to(dtype), C.to(dtype), D, z.to(dtype), dt_bias]


def _both(pool, args, lengths, slots, init, **kw):
    ref_pool = pool.clone()
    common = (qsl(lengths), slots, torch.tensor(init), True)
    got = mamba1_scan_triton(pool, *args, *common, **kw)
    want = mamba1_scan_ref(ref_pool, *args, *common, **kw)
    return got, want, ref_pool


@pytest.mark.slow  # interpreted Triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ragged_requests_match_reference(dtype):
    check_ragged_requests(_both, _case, (SLOTS, D_IN, N), [1, 7, 12, 0, 3],
                          [True, False, True, False, True], dtype, TOL[dtype])


@pytest.mark.slow  # interpreted Triton
def test_without_gate_skip_or_bias_and_a_half_pool():
    gen = torch.Generator().manual_seed(1)
    lengths = [4, 9]
    x, dt, A, B, C, _, _, _ = _case(gen, lengths, torch.float32)
    pool = torch.randn(SLOTS, D_IN, N, generator=gen).half()
    slots = torch.tensor([4, 2], dtype=torch.int32)
    got, want, ref_pool = _both(pool, (x, dt.abs(), A, B, C, None, None, None), lengths, slots,
                                [True, True])
    assert rel_err(got, want) < 1e-3 and rel_err(pool, ref_pool) < 1e-3


@pytest.mark.slow  # interpreted Triton
def test_two_calls_equal_one_call_and_checkpoints():
    gen = torch.Generator().manual_seed(2)
    lengths, cut = [13, 6], [8, 1]
    args = _case(gen, lengths, torch.float32)
    pool = torch.randn(SLOTS, D_IN, N, generator=gen)
    one = pool.clone()
    slots = torch.tensor([3, 6], dtype=torch.int32)
    positions = [[8, 2, 13, 8], [1, 6]]
    (y_one, states), (y_ref, ref_states), _ = _both(one, args, lengths, slots, [True, False],
                                                    return_states_at=positions)
    assert rel_err(y_one, y_ref) < 2e-5
    assert_states_match(states, ref_states)
    y_two = torch.empty_like(y_one)
    for rows, starts, init in split_in_two(lengths, cut, [True, False]):
        y_two[rows] = mamba1_scan_triton(pool, *per_token_rows(args, rows, sum(lengths)), starts,
                                         slots, init)
    assert rel_err(y_two, y_one) < 2e-5 and rel_err(pool, one) < 2e-5


@pytest.mark.parametrize("bad", ["shape", "position"])
def test_bad_input_raises_and_changes_nothing(bad):
    kw = {"return_states_at": [[0]]} if bad == "position" else {}
    match = {"shape": "A \\(10, 4\\)", "position": "position 0 of request 0 is outside 1..4"}[bad]
    check_refused_and_unchanged(
        lambda pool, args, *rest, **kw: mamba1_scan_triton(pool, *args, *rest, **kw), _case,
        (SLOTS, D_IN, N), match,
        spoil=(lambda a: a[:2] + [a[2][:, :4]] + a[3:]) if bad == "shape" else None, **kw)


@pytest.mark.slow  # interpreted Triton
def test_public_api_dispatches_to_triton(monkeypatch):
    import hybridkv.kernels.mamba1_prefill as mp

    check_public_api_dispatches_to_triton(monkeypatch, mp, "mamba1_scan_triton", "mamba1_scan",
                                          _case, (SLOTS, D_IN, N), [3, 5])
