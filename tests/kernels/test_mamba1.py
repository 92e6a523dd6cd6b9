"""Mamba1 selective scan over state slots: the torch reference against transformers' Jamba torch
functions, and the Triton step kernel against the reference."""
import pytest
import torch
from transformers.models.jamba import modeling_jamba as jm

from hybridkv.kernels.mamba1_ref import mamba1_scan_ref, mamba1_state_update_ref
from state_kernel_helpers import pieces, qsl, rel_err, shuffled_slots, torch_path, untouched

hf_scan = torch_path(jm.mamba_selective_scan)
hf_step = torch_path(jm.mamba_selective_state_update)

D_IN, N, SLOTS = 10, 6, 7


def _params(gen):
    A = -torch.exp(torch.randn(D_IN, N, generator=gen) * 0.5)
    D = torch.randn(D_IN, generator=gen)
    dt_bias = torch.randn(D_IN, generator=gen) * 0.5
    return A, D, dt_bias


def _inputs(gen, T):
    x = torch.randn(T, D_IN, generator=gen)
    dt = torch.randn(T, D_IN, generator=gen)
    B = torch.randn(T, N, generator=gen)
    C = torch.randn(T, N, generator=gen)
    z = torch.randn(T, D_IN, generator=gen)
    return x, dt, B, C, z


def _hf_one_pass(x, dt, A, B, C, D, z, dt_bias):
    """transformers' Jamba scan from a zero state: (y [L, d], final state [d, N])."""
    y, h = hf_scan(x.t()[None], dt.t()[None], A, B.t()[None], C.t()[None], D=D, z=z.t()[None],
                   delta_bias=dt_bias, delta_softplus=True, return_last_state=True)
    return y[0].t(), h[0]


def _hf_steps(h0, x, dt, A, B, C, D, z, dt_bias):
    """transformers' Jamba decode step, token by token from state h0 [d, N]."""
    state, ys = h0.clone()[None], []
    for t in range(x.shape[0]):
        ys.append(hf_step(state, x[t:t + 1], dt[t:t + 1], A, B[t:t + 1], C[t:t + 1], D,
                          dt_bias=dt_bias, dt_softplus=True, z=z[t:t + 1])[0])
    return torch.stack(ys), state[0]


def _call_scan(pool, inp, params, lengths, slots, init, return_states_at=None):
    x, dt, B, C, z = inp
    A, D, dt_bias = params
    return mamba1_scan_ref(pool, x, dt, A, B, C, D, z, dt_bias, qsl(lengths), slots,
                           torch.tensor(init), True, return_states_at)


def test_one_pass_and_chunked_match_transformers():
    gen = torch.Generator().manual_seed(0)
    params, T = _params(gen), 36
    inp = _inputs(gen, T)
    x, dt, B, C, z = inp
    A, D, dt_bias = params
    want_y, want_h = _hf_one_pass(x, dt, A, B, C, D, z, dt_bias)
    pool = torch.randn(SLOTS, D_IN, N, generator=gen)
    slot = torch.tensor([4], dtype=torch.int32)
    y = _call_scan(pool, inp, params, [T], slot, [False])
    assert rel_err(y, want_y) < 1e-5 and rel_err(pool[4], want_h) < 1e-5
    pool = torch.randn(SLOTS, D_IN, N, generator=gen)
    outs = []
    for i, (s, e) in enumerate(pieces(T)):
        outs.append(_call_scan(pool, [t[s:e] for t in inp], params, [e - s], slot, [i > 0]))
    assert rel_err(torch.cat(outs), want_y) < 1e-5 and rel_err(pool[4], want_h) < 1e-5


def test_varlen_from_slot_states_matches_transformers_steps():
    gen = torch.Generator().manual_seed(1)
    params = _params(gen)
    lengths, init = [7, 1, 12, 3], [True, False, True, False]
    inp = _inputs(gen, sum(lengths))
    pool = torch.randn(SLOTS, D_IN, N, generator=gen)
    before = pool.clone()
    slots = shuffled_slots(len(lengths), SLOTS, gen)
    y = _call_scan(pool, inp, params, lengths, slots, init)
    A, D, dt_bias = params
    start = 0
    for n, has, s in zip(lengths, init, slots.tolist()):
        x, dt, B, C, z = (t[start:start + n] for t in inp)
        h0 = before[s] if has else torch.zeros(D_IN, N)
        want_y, want_h = _hf_steps(h0, x, dt, A, B, C, D, z, dt_bias)
        assert rel_err(y[start:start + n], want_y) < 1e-5
        assert rel_err(pool[s], want_h) < 1e-5
        start += n
    assert untouched(before, pool, slots)


def test_return_states_at_equals_prefix_state():
    gen = torch.Generator().manual_seed(2)
    params = _params(gen)
    lengths = [20, 9]
    inp = _inputs(gen, sum(lengths))
    pool = torch.randn(SLOTS, D_IN, N, generator=gen)
    slots = torch.tensor([2, 6], dtype=torch.int32)
    _, states = _call_scan(pool, inp, params, lengths, slots, [False, False], [[16, 5, 20], [9]])
    A, D, dt_bias = params
    for pos, got in zip([16, 5, 20], states[0]):
        x, dt, B, C, z = (t[:pos] for t in inp)
        assert rel_err(got, _hf_one_pass(x, dt, A, B, C, D, z, dt_bias)[1]) < 1e-5
    assert states[1].shape == (1, D_IN, N) and torch.equal(states[1][0], pool[6])
    assert torch.equal(states[0][2], pool[2])


def test_decode_step_matches_transformers():
    gen = torch.Generator().manual_seed(3)
    A, D, dt_bias = _params(gen)
    x, dt, B, C, z = _inputs(gen, 3)
    pool = torch.randn(SLOTS, D_IN, N, generator=gen)
    before = pool.clone()
    slots = shuffled_slots(3, SLOTS, gen)
    y = mamba1_state_update_ref(pool, x, dt, A, B, C, D, z, dt_bias, slots, True)
    state = before[slots.long()].clone()
    want = hf_step(state, x, dt, A, B, C, D, dt_bias=dt_bias, dt_softplus=True, z=z)
    assert rel_err(y, want) < 1e-6 and rel_err(pool[slots.long()], state) < 1e-6
    assert untouched(before, pool, slots)


@pytest.mark.parametrize("bad", ["slot", "position"])
def test_errors_name_the_bad_value(bad):
    gen = torch.Generator().manual_seed(4)
    params = _params(gen)
    inp = _inputs(gen, 5)
    pool = torch.randn(SLOTS, D_IN, N, generator=gen)
    if bad == "slot":
        with pytest.raises(ValueError, match="slot index 9"):
            _call_scan(pool, inp, params, [5], torch.tensor([9], dtype=torch.int32), [True])
    else:
        with pytest.raises(ValueError, match="position 6"):
            _call_scan(pool, inp, params, [5], torch.tensor([1], dtype=torch.int32), [True], [[6]])


# ---- Triton step kernel against the reference (TRITON_INTERPRET=1 on CPU) ----

TOL = {torch.float32: 1e-4, torch.float16: 2e-3}


@pytest.mark.slow  # interpreted Triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gated", [True, False])
def test_triton_step_matches_reference(dtype, gated):
    from hybridkv.kernels.mamba1 import mamba1_state_update_triton

    gen = torch.Generator().manual_seed(20)
    A, D, dt_bias = _params(gen)
    x, dt, B, C, z = (t.to(dtype) for t in _inputs(gen, 4))
    z = z if gated else None
    pool = torch.randn(SLOTS, D_IN, N, generator=gen)  # fp32 states beside fp16 inputs
    before, ref_pool = pool.clone(), pool.clone()
    slots = shuffled_slots(4, SLOTS, gen)
    bias = dt_bias if gated else None
    want = mamba1_state_update_ref(ref_pool, x, dt, A, B, C, D, z, bias, slots, True)
    got = mamba1_state_update_triton(pool, x, dt, A, B, C, D, z, bias, slots, True)
    assert got.dtype == dtype
    assert rel_err(got, want) < TOL[dtype] and rel_err(pool, ref_pool) < TOL[dtype]
    assert untouched(before, pool, slots)


@pytest.mark.slow  # interpreted Triton
def test_public_api_runs_both_backends(monkeypatch):
    import hybridkv.kernels as hk

    gen = torch.Generator().manual_seed(21)
    A, D, dt_bias = _params(gen)
    x, dt, B, C, z = _inputs(gen, 2)
    res = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("HYBRIDKV_BACKEND", backend)
        pool = torch.randn(SLOTS, D_IN, N, generator=torch.Generator().manual_seed(22))
        y = hk.mamba1_state_update(pool, x, dt, A, B, C, D, z, dt_bias,
                                   torch.tensor([3, 1], dtype=torch.int32))
        res[backend] = (y, pool)
    assert rel_err(res["triton"][0], res["torch"][0]) < 1e-4
    assert rel_err(res["triton"][1], res["torch"][1]) < 1e-4
