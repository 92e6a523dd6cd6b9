"""Triton varlen chunked SSD (kernels/ssd_prefill.py) against the torch reference, interpreted on CPU."""
import pytest
import torch

from hybridkv.kernels.mamba2_ref import mamba2_chunk_scan_ref
from hybridkv.kernels.ssd_prefill import mamba2_chunk_scan_triton
from state_kernel_helpers import qsl, rel_err, shuffled_slots, untouched

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ragged_requests_match_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    lengths = [1, CS - 1, CS, CS + 1, 2 * CS + 3, 0]
    init = [True, False, True, True, False, False]
    args = _case(gen, lengths, dtype)
    pool = torch.randn(SLOTS, H, P, N, generator=gen)
    before = pool.clone()
    slots = shuffled_slots(len(lengths), SLOTS, gen)
    got, want, ref_pool = _both(pool, args, lengths, slots, init, dt_limit=LIMIT)
    assert got.dtype == dtype and rel_err(got, want) < TOL[dtype]
    assert rel_err(pool, ref_pool) < TOL[dtype]
    assert untouched(before, pool, slots)
    assert torch.equal(pool[slots[-1].long()], torch.zeros(H, P, N))  # empty, no initial state


def test_without_gate_skip_or_bias():
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 13]
    x, dt, A, B, C, _, _, _ = _case(gen, lengths, torch.float32)
    pool = torch.randn(SLOTS, H, P, N, generator=gen)
    slots = torch.tensor([4, 2], dtype=torch.int32)
    got, want, ref_pool = _both(pool, (x, dt, A, B, C, None, None, None), lengths, slots,
                                [True, True])
    assert rel_err(got, want) < TOL[torch.float32] and rel_err(pool, ref_pool) < 2e-5


def test_two_calls_equal_one_call():
    gen = torch.Generator().manual_seed(2)
    lengths, cut = [19, 7], [11, 1]
    args = _case(gen, lengths, torch.float32)
    pool = torch.randn(SLOTS, H, P, N, generator=gen)
    one = pool.clone()
    slots = torch.tensor([3, 6], dtype=torch.int32)
    y_one = mamba2_chunk_scan_triton(one, *args, qsl(lengths), slots, torch.tensor([True, False]),
                                     CS, True)
    starts = [0, lengths[0]]
    first = [torch.arange(s, s + c) for s, c in zip(starts, cut)]
    second = [torch.arange(s + c, s + n) for s, c, n in zip(starts, cut, lengths)]
    ys = []
    for rows, init, lens in ((first, [True, False], cut),
                             (second, [True, True], [n - c for n, c in zip(lengths, cut)])):
        idx = torch.cat(rows)
        part = [t[idx] if t is not None and t.shape[0] == sum(lengths) and t.dim() > 1 else t
                for t in args]
        ys.append(mamba2_chunk_scan_triton(pool, *part, qsl(lens), slots, torch.tensor(init),
                                           CS, True))
    y_two = torch.empty_like(y_one)
    y_two[torch.cat(first)] = ys[0]
    y_two[torch.cat(second)] = ys[1]
    assert rel_err(y_two, y_one) < 2e-5 and rel_err(pool, one) < 2e-5


def test_return_states_at_match_reference():
    gen = torch.Generator().manual_seed(3)
    lengths = [2 * CS + 5, 3, 6]
    args = _case(gen, lengths, torch.float32)
    pool = torch.randn(SLOTS, H, P, N, generator=gen)
    slots = torch.tensor([5, 1, 7], dtype=torch.int32)
    positions = [[CS, 3, 2 * CS + 5, CS], [], [1, 6]]
    (got, got_states), (want, want_states), ref_pool = _both(
        pool, args, lengths, slots, [True, False, True], return_states_at=positions)
    assert rel_err(got, want) < 2e-5 and rel_err(pool, ref_pool) < 2e-5
    for g_s, w_s in zip(got_states, want_states):
        assert g_s.shape == w_s.shape
        if w_s.numel():
            assert rel_err(g_s, w_s) < 2e-5


@pytest.mark.parametrize("bad", ["chunk", "slot", "position"])
def test_bad_input_raises_and_changes_nothing(bad):
    gen = torch.Generator().manual_seed(4)
    args = _case(gen, [4], torch.float32)
    pool = torch.randn(SLOTS, H, P, N, generator=gen)
    before = pool.clone()
    slots = torch.tensor([SLOTS if bad == "slot" else 2], dtype=torch.int32)
    kw = {"return_states_at": [[5]]} if bad == "position" else {}
    match = {"chunk": "chunk_size must be positive, got 0", "slot": f"slot index {SLOTS}",
             "position": "position 5 of request 0 is outside 1..4"}[bad]
    with pytest.raises(ValueError, match=match):
        mamba2_chunk_scan_triton(pool, *args, qsl([4]), slots, torch.tensor([True]),
                                 0 if bad == "chunk" else CS, True, **kw)
    assert torch.equal(pool, before)


def test_public_api_dispatches_to_triton(monkeypatch):
    import hybridkv.kernels as hk
    import hybridkv.kernels.ssd_prefill as ssd

    calls = []
    monkeypatch.setattr(ssd, "mamba2_chunk_scan_triton",
                        lambda *a, **k: calls.append(1) or mamba2_chunk_scan_triton(*a, **k))
    gen = torch.Generator().manual_seed(5)
    lengths = [3, 9]
    args = _case(gen, lengths, torch.float32)
    pool = torch.randn(SLOTS, H, P, N, generator=gen)
    res = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("HYBRIDKV_BACKEND", backend)
        p = pool.clone()
        y = hk.mamba2_chunk_scan(p, *args, qsl(lengths), torch.tensor([2, 8], dtype=torch.int32),
                                 torch.tensor([True, False]), chunk_size=CS, dt_limit=LIMIT)
        res[backend] = (y, p)
    assert calls == [1]  # the Triton path ran once, the torch one without it
    assert rel_err(res["triton"][0], res["torch"][0]) < 2e-5
    assert rel_err(res["triton"][1], res["torch"][1]) < 2e-5


def test_plan_is_reused_for_the_same_tensors_and_rebuilt_when_they_change():
    from hybridkv.kernels.scan_plan import build_scan_plan

    q, s, i = qsl([3, 5]), torch.tensor([1, 2], dtype=torch.int32), torch.tensor([True, False])
    first = build_scan_plan(q, s, i, SLOTS, 8, CS, None, "cpu")
    assert build_scan_plan(q, s, i, SLOTS, 8, CS, None, "cpu") is first  # the next layer
    assert build_scan_plan(q, s, i, SLOTS, 8, 2, None, "cpu") is not first  # another chunk size
    s[1] = 4  # written in place: the version changes, so the plan is rebuilt
    again = build_scan_plan(q, s, i, SLOTS, 8, CS, None, "cpu")
    assert again is not first and again.req_slot.tolist() == [1, 4]


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
