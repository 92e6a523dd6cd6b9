"""Triton varlen chunked Kimi delta attention (kernels/kda_prefill.py) against the torch reference,
interpreted on CPU."""
import pytest
import torch
import torch.nn.functional as F

from hybridkv.kernels.kda_prefill import kda_chunk_scan_triton
from hybridkv.kernels.kda_ref import kda_chunk_scan_ref
from state_kernel_helpers import qsl, rel_err, shuffled_slots, untouched

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ragged_requests_match_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    lengths = [1, CS - 1, CS, CS + 1, 2 * CS + 3, 0]
    init = [True, False, True, True, False, False]
    args = _case(gen, lengths, dtype)
    pool = torch.randn(SLOTS, H, K, V, generator=gen)
    before = pool.clone()
    slots = shuffled_slots(len(lengths), SLOTS, gen)
    got, want, ref_pool = _both(pool, args, lengths, slots, init)
    assert got.dtype == dtype and rel_err(got, want) < TOL[dtype]
    assert rel_err(pool, ref_pool) < TOL[dtype]
    assert untouched(before, pool, slots)
    assert torch.equal(pool[slots[-1].long()], torch.zeros(H, K, V))  # empty, no initial state


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


def test_two_calls_equal_one_call():
    gen = torch.Generator().manual_seed(2)
    lengths, cut = [19, 7], [11, 1]
    args = _case(gen, lengths, torch.float32)
    pool = torch.randn(SLOTS, H, K, V, generator=gen)
    one = pool.clone()
    slots = torch.tensor([3, 6], dtype=torch.int32)
    o_one = kda_chunk_scan_triton(one, *args, qsl(lengths), slots, torch.tensor([True, False]),
                                  chunk_size=CS)
    starts = [0, lengths[0]]
    first = torch.cat([torch.arange(s, s + c) for s, c in zip(starts, cut)])
    second = torch.cat([torch.arange(s + c, s + n) for s, c, n in zip(starts, cut, lengths)])
    o_two = torch.empty_like(o_one)
    for rows, init, lens in ((first, [True, False], cut),
                             (second, [True, True], [n - c for n, c in zip(lengths, cut)])):
        o_two[rows] = kda_chunk_scan_triton(pool, *[t[rows] for t in args], qsl(lens), slots,
                                            torch.tensor(init), chunk_size=CS)
    assert rel_err(o_two, o_one) < 2e-5 and rel_err(pool, one) < 2e-5


def test_return_states_at_match_reference():
    gen = torch.Generator().manual_seed(3)
    lengths = [2 * CS + 5, 3, 6]
    args = _case(gen, lengths, torch.float32)
    pool = torch.randn(SLOTS, H, K, V, generator=gen)
    slots = torch.tensor([5, 1, 7], dtype=torch.int32)
    positions = [[CS, 3, 2 * CS + 5, CS], [], [1, 6]]
    (got, got_states), (want, want_states), ref_pool = _both(
        pool, args, lengths, slots, [True, False, True], return_states_at=positions)
    assert rel_err(got, want) < 2e-5 and rel_err(pool, ref_pool) < 2e-5
    for g_s, w_s in zip(got_states, want_states):
        assert g_s.shape == w_s.shape
        if w_s.numel():
            assert rel_err(g_s, w_s) < 2e-5


@pytest.mark.parametrize("bad", ["gate", "slot"])
def test_bad_input_raises_and_changes_nothing(bad):
    gen = torch.Generator().manual_seed(4)
    q, k, v, g, beta = _case(gen, [4], torch.float32)
    if bad == "gate":
        g = g[..., :1]  # one gate per head (GDN's layout), not one per key channel
    pool = torch.randn(SLOTS, H, K, V, generator=gen)
    before = pool.clone()
    slots = torch.tensor([SLOTS if bad == "slot" else 2], dtype=torch.int32)
    match = {"gate": "g \\(4, 2, 1\\)", "slot": f"slot index {SLOTS}"}[bad]
    with pytest.raises(ValueError, match=match):
        kda_chunk_scan_triton(pool, q, k, v, g, beta, qsl([4]), slots, torch.tensor([True]),
                              chunk_size=CS)
    assert torch.equal(pool, before)


def test_public_api_dispatches_to_triton(monkeypatch):
    import hybridkv.kernels as hk
    import hybridkv.kernels.kda_prefill as kp

    calls = []
    monkeypatch.setattr(kp, "kda_chunk_scan_triton",
                        lambda *a, **k: calls.append(1) or kda_chunk_scan_triton(*a, **k))
    gen = torch.Generator().manual_seed(5)
    lengths = [3, 9]
    args = _case(gen, lengths, torch.float32)
    pool = torch.randn(SLOTS, H, K, V, generator=gen)
    res = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("HYBRIDKV_BACKEND", backend)
        p = pool.clone()
        o = hk.kda_chunk_scan(p, *args, qsl(lengths), torch.tensor([2, 8], dtype=torch.int32),
                              torch.tensor([True, False]), chunk_size=CS)
        res[backend] = (o, p)
    assert calls == [1]  # the Triton path ran once, the torch one without it
    assert rel_err(res["triton"][0], res["torch"][0]) < 2e-5
    assert rel_err(res["triton"][1], res["torch"][1]) < 2e-5


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
