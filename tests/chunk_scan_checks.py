"""Checks shared by the Triton varlen prefill kernel tests (SSD, GDN, KDA, lightning, Mamba1).

Each test file supplies what is specific to its kernel: `case(gen, lengths, dtype)` builds the
inputs, `both(pool, args, lengths, slots, init, **kw)` runs Triton on `pool` and the torch
reference on a clone and returns (triton result, reference result, reference pool), and `run`
calls the Triton kernel alone. The checks here draw from the generator in a fixed order, so a case
is the same tensors wherever it is checked.
"""
from __future__ import annotations

import pytest
import torch

from state_kernel_helpers import qsl, rel_err, shuffled_slots, untouched

EXACT_TOL = 2e-5  # fp32 everywhere: only the summation order differs


def per_token_rows(args, rows, total: int) -> list:
    """Each argument with one row per token cut to `rows`; per-head parameters and None kept."""
    return [t[rows] if t is not None and t.dim() > 1 and t.shape[0] == total else t for t in args]


def split_in_two(lengths: list[int], cut: list[int], init: list[bool]):
    """The two calls that cut request i after cut[i] tokens: (token rows, query_start_loc,
    has_initial_state) each; the second continues every request from the state the first left."""
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    first = torch.cat([torch.arange(s, s + c) for s, c in zip(starts, cut)])
    second = torch.cat([torch.arange(s + c, s + n) for s, c, n in zip(starts, cut, lengths)])
    rest = [n - c for n, c in zip(lengths, cut)]
    return [(first, qsl(cut), torch.tensor(init)),
            (second, qsl(rest), torch.ones(len(lengths), dtype=torch.bool))]


def assert_states_match(got_states, want_states, tol: float = EXACT_TOL):
    """Per-request checkpoint stacks have the reference's shapes and values (empty ones too)."""
    assert len(got_states) == len(want_states)
    for g_s, w_s in zip(got_states, want_states):
        assert g_s.shape == w_s.shape
        if w_s.numel():
            assert rel_err(g_s, w_s) < tol


def check_ragged_requests(both, case, pool_shape, lengths, init, dtype, tol, **kw):
    """Ragged requests in shuffled slots: outputs and written states match the reference, every
    other slot stays bit-identical, and the empty request without initial state ends zeroed."""
    gen = torch.Generator().manual_seed(0)
    args = case(gen, lengths, dtype)
    pool = torch.randn(*pool_shape, generator=gen)
    before = pool.clone()
    slots = shuffled_slots(len(lengths), pool_shape[0], gen)
    got, want, ref_pool = both(pool, args, lengths, slots, init, **kw)
    assert got.dtype == dtype and rel_err(got, want) < tol
    assert rel_err(pool, ref_pool) < tol
    assert untouched(before, pool, slots)
    empty = lengths.index(0)
    assert not init[empty], "the empty request must start without a state to end zeroed"
    assert torch.equal(pool[slots[empty].long()], torch.zeros(pool_shape[1:]))


def check_two_calls_equal_one_call(run, case, pool_shape):
    """Cutting each request in two calls (the second from the saved state) gives the one-call
    outputs and final states. `run(pool, args, query_start_loc, slots, has_initial_state)`."""
    gen = torch.Generator().manual_seed(2)
    lengths, cut = [19, 7], [11, 1]
    args = case(gen, lengths, torch.float32)
    pool = torch.randn(*pool_shape, generator=gen)
    one = pool.clone()
    slots = torch.tensor([3, 6], dtype=torch.int32)
    o_one = run(one, args, qsl(lengths), slots, torch.tensor([True, False]))
    o_two = torch.empty_like(o_one)
    for rows, starts, init in split_in_two(lengths, cut, [True, False]):
        o_two[rows] = run(pool, per_token_rows(args, rows, sum(lengths)), starts, slots, init)
    assert rel_err(o_two, o_one) < EXACT_TOL and rel_err(pool, one) < EXACT_TOL


def check_return_states_at(both, case, pool_shape, chunk_size: int):
    """States saved at chunk boundaries, mid-chunk, at the end and repeated match the reference."""
    gen = torch.Generator().manual_seed(3)
    lengths = [2 * chunk_size + 5, 3, 6]
    args = case(gen, lengths, torch.float32)
    pool = torch.randn(*pool_shape, generator=gen)
    slots = torch.tensor([5, 1, 7], dtype=torch.int32)
    positions = [[chunk_size, 3, 2 * chunk_size + 5, chunk_size], [], [1, 6]]
    (got, got_states), (want, want_states), ref_pool = both(
        pool, args, lengths, slots, [True, False, True], return_states_at=positions)
    assert rel_err(got, want) < EXACT_TOL and rel_err(pool, ref_pool) < EXACT_TOL
    assert_states_match(got_states, want_states)


def check_public_api_dispatches_to_triton(monkeypatch, module, triton_name: str, public_name: str,
                                          case, pool_shape, lengths, **kw):
    """With HYBRIDKV_BACKEND=triton the public entry point runs `module.triton_name` once (and not
    with =torch), and both backends agree on outputs and states."""
    import hybridkv.kernels as hk

    triton_fn = getattr(module, triton_name)
    calls = []
    monkeypatch.setattr(module, triton_name, lambda *a, **k: calls.append(1) or triton_fn(*a, **k))
    gen = torch.Generator().manual_seed(5)
    args = case(gen, lengths, torch.float32)
    pool = torch.randn(*pool_shape, generator=gen)
    res = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("HYBRIDKV_BACKEND", backend)
        p = pool.clone()
        out = getattr(hk, public_name)(p, *args, qsl(lengths),
                                       torch.tensor([2, 8], dtype=torch.int32),
                                       torch.tensor([True, False]), **kw)
        res[backend] = (out, p)
    assert calls == [1]  # the Triton path ran once, the torch one without it
    assert rel_err(res["triton"][0], res["torch"][0]) < EXACT_TOL
    assert rel_err(res["triton"][1], res["torch"][1]) < EXACT_TOL


def check_refused_and_unchanged(run, case, pool_shape, match: str, spoil=None, slot: int = 2,
                                **kw):
    """One 4-token request whose inputs `spoil(args)` breaks (or whose slot / keywords are bad)
    raises ValueError matching `match` and leaves the pool bit-identical.
    `run(pool, args, query_start_loc, slots, has_initial_state, **kw)`."""
    gen = torch.Generator().manual_seed(4)
    args = list(case(gen, [4], torch.float32))
    if spoil is not None:
        args = spoil(args)
    pool = torch.randn(*pool_shape, generator=gen)
    before = pool.clone()
    with pytest.raises(ValueError, match=match):
        run(pool, args, qsl([4]), torch.tensor([slot], dtype=torch.int32), torch.tensor([True]),
            **kw)
    assert torch.equal(pool, before)
