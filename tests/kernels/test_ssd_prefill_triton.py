"""Triton varlen chunked SSD (kernels/ssd_prefill.py) against the torch reference, interpreted on CPU."""
import pytest
import torch

from hybridkv.kernels.mamba2_ref import mamba2_chunk_scan_ref
from hybridkv.kernels.ssd_prefill import mamba2_chunk_scan_triton
from chunk_scan_checks import (check_public_api_dispatches_to_triton, check_ragged_requests,
                               check_refused_and_unchanged, check_return_states_at,
                               check_two_calls_equal_one_call)
from state_kernel_helpers import qsl, rel_err

H, P, G, N, SLOTS, CS = 4, 6, 2, 5, 9, 8
LIMIT = (0.05, 1.5)
TOL = {torch.float32: 2e-5, torch.float16: 4e-3}


def _case(gen, lengths, dtype):
    T = sum(lengths)
    A = -torch.exp(torch.randn(H, generator=gen) * 0.5)
    D = torch.randn(H, generator=gen)
    dt_bias = torch.randn(H, generator=gen) * 0.5
    x, z = torch.randn(T, H, P, generator=gen), torch.randn(T, H, P, generator=gen)
    dt = torch.randn(T, H, generator=gen)
    B, C = torch.randn(T, G, N, generator=gen), torch.randn(T, G, N, generator=gen)
    return [t.to(dtype) for t in (x, dt)] + [A] + [t.to(dtype) for t in (B, C)] + [D, z.to(dtype),
                                                                                  dt_bias]


def _both(pool, args, lengths, slots, init, **kw):
    """(triton result, reference result, triton pool, reference pool) from the same pool."""
    ref_pool = pool.clone()
    common = (qsl(lengths), slots, torch.tensor(init), CS)
    got = mamba2_chunk_scan_triton(pool, *args, *common, True, **kw)
    want = mamba2_chunk_scan_ref(ref_pool, *args, *common, True, **kw)
    return got, want, ref_pool


@pytest.mark.slow  # interpreted Triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ragged_requests_match_reference(dtype):
    check_ragged_requests(_both, _case, (SLOTS, H, P, N), [1, CS - 1, CS, CS + 1, 2 * CS + 3, 0],
                          [True, False, True, True, False, False], dtype, TOL[dtype],
                          dt_limit=LIMIT)


@pytest.mark.slow  # interpreted Triton
def test_without_gate_skip_or_bias():
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 13]
    x, dt, A, B, C, _, _, _ = _case(gen, lengths, torch.float32)
    pool = torch.randn(SLOTS, H, P, N, generator=gen)
    slots = torch.tensor([4, 2], dtype=torch.int32)
    got, want, ref_pool = _both(pool, (x, dt, A, B, C, None, None, None), lengths, slots,
                                [True, True])
    assert rel_err(got, want) < TOL[torch.float32] and rel_err(pool, ref_pool) < 2e-5


@pytest.mark.slow  # interpreted Triton
def test_two_calls_equal_one_call():
    check_two_calls_equal_one_call(
        lambda pool, args, starts, slots, init: mamba2_chunk_scan_triton(
            pool, *args, starts, slots, init, CS, True), _case, (SLOTS, H, P, N))


@pytest.mark.slow  # interpreted Triton
def test_return_states_at_match_reference():
    check_return_states_at(_both, _case, (SLOTS, H, P, N), CS)


@pytest.mark.parametrize("bad", ["chunk", "slot", "position"])
def test_bad_input_raises_and_changes_nothing(bad):
    kw = {"return_states_at": [[5]]} if bad == "position" else {}
    match = {"chunk": "chunk_size must be positive, got 0", "slot": f"slot index {SLOTS}",
             "position": "position 5 of request 0 is outside 1..4"}[bad]
    check_refused_and_unchanged(
        lambda pool, args, *rest, **kw: mamba2_chunk_scan_triton(
            pool, *args, *rest, 0 if bad == "chunk" else CS, True, **kw),
        _case, (SLOTS, H, P, N), match, slot=SLOTS if bad == "slot" else 2, **kw)


@pytest.mark.slow  # interpreted Triton
def test_public_api_dispatches_to_triton(monkeypatch):
    import hybridkv.kernels.ssd_prefill as ssd

    check_public_api_dispatches_to_triton(monkeypatch, ssd, "mamba2_chunk_scan_triton",
                                          "mamba2_chunk_scan", _case, (SLOTS, H, P, N), [3, 9],
                                          chunk_size=CS, dt_limit=LIMIT)


def test_plan_is_reused_for_the_same_tensors_and_rebuilt_when_they_change():
    from hybridkv.kernels.scan_plan import build_scan_plan

    q, s, i = qsl([3, 5]), torch.tensor([1, 2], dtype=torch.int32), torch.tensor([True, False])
    first = build_scan_plan(q, s, i, SLOTS, 8, CS, None, "cpu")
    assert build_scan_plan(q, s, i, SLOTS, 8, CS, None, "cpu") is first  # the next layer
    assert build_scan_plan(q, s, i, SLOTS, 8, 2, None, "cpu") is not first  # another chunk size
    s[1] = 4  # written in place: the version changes, so the plan is rebuilt
    again = build_scan_plan(q, s, i, SLOTS, 8, CS, None, "cpu")
    assert again is not first and again.req_slot.tolist() == [1, 4]


@pytest.mark.slow  # interpreted Triton
def test_several_tiles_per_chunk_and_head():
    """chunk_size 80 (two 64-row tiles, the second partial) and head_dim 70 (two P blocks)."""
    gen = torch.Generator().manual_seed(6)
    h, p, g, n, cs, cs_len = 2, 70, 1, 4, 80, 81
    lengths = [cs_len, 3]
    T = sum(lengths)
    A = -torch.exp(torch.randn(h, generator=gen) * 0.5)
    x, z = torch.randn(T, h, p, generator=gen), torch.randn(T, h, p, generator=gen)
    dt = torch.randn(T, h, generator=gen) - 2.0  # small steps: the state keeps a long memory
    B, C = torch.randn(T, g, n, generator=gen), torch.randn(T, g, n, generator=gen)
    args = (x, dt, A, B, C, torch.randn(h, generator=gen), z, None)
    pool = torch.randn(4, h, p, n, generator=gen)
    ref_pool = pool.clone()
    common = (qsl(lengths), torch.tensor([3, 1], dtype=torch.int32), torch.tensor([True, False]))
    got, got_states = mamba2_chunk_scan_triton(pool, *args, *common, cs, True, [[70, cs_len], []])
    want, want_states = mamba2_chunk_scan_ref(ref_pool, *args, *common, cs, True,
                                              [[70, cs_len], []])
    assert rel_err(got, want) < 2e-5 and rel_err(pool, ref_pool) < 2e-5
    assert rel_err(got_states[0], want_states[0]) < 2e-5
