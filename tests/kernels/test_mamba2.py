"""Mamba2 SSD over state slots: the torch reference against transformers' Bamba torch functions,
and the Triton step kernel against the reference."""
import pytest
import torch
from transformers.models.bamba import modeling_bamba as bm

from hybridkv.kernels.mamba2_ref import mamba2_chunk_scan_ref, mamba2_state_update_ref
from state_kernel_helpers import pieces, qsl, rel_err, shuffled_slots, torch_path, untouched

hf_chunk = torch_path(bm.mamba2_chunk_scan)
hf_step = torch_path(bm.mamba2_selective_state_update)

H, P, G, N, SLOTS = 4, 6, 2, 5, 7
LIMIT = (0.05, 1.5)  # a non-default time_step_limit, so the clamp is exercised


def _params(gen):
    A = -torch.exp(torch.randn(H, generator=gen) * 0.5)
    D = torch.randn(H, generator=gen)
    dt_bias = torch.randn(H, generator=gen) * 0.5
    return A, D, dt_bias


def _inputs(gen, T):
    x = torch.randn(T, H, P, generator=gen)
    dt = torch.randn(T, H, generator=gen)
    B = torch.randn(T, G, N, generator=gen)
    C = torch.randn(T, G, N, generator=gen)
    return x, dt, B, C


def _hf(x, dt, B, C, params, h0=None, chunk_size=8, dt_limit=(0.0, float("inf"))):
    """transformers' Bamba chunked scan for one request: (y [L, H, P], final state [H, P, N])."""
    A, D, dt_bias = params
    y, h = hf_chunk(x[None], dt[None], A, B[None], C[None], chunk_size, D=D, dt_bias=dt_bias,
                    initial_states=None if h0 is None else h0[None], dt_softplus=True,
                    dt_limit=dt_limit, return_final_states=True)
    return y[0], h[0]


def _call(pool, inp, params, lengths, slots, init, chunk_size=16, return_states_at=None,
          z=None, dt_limit=None):
    x, dt, B, C = inp
    A, D, dt_bias = params
    return mamba2_chunk_scan_ref(pool, x, dt, A, B, C, D, z, dt_bias, qsl(lengths), slots,
                                 torch.tensor(init), chunk_size, True, return_states_at,
                                 dt_limit=dt_limit)


@pytest.mark.parametrize("chunk_size", [4, 16])
def test_one_pass_and_chunked_match_transformers(chunk_size):
    gen = torch.Generator().manual_seed(0)
    params, T = _params(gen), 37
    inp = _inputs(gen, T)
    want_y, want_h = _hf(*inp, params, dt_limit=LIMIT)
    pool = torch.randn(SLOTS, H, P, N, generator=gen)
    slot = torch.tensor([3], dtype=torch.int32)
    y = _call(pool, inp, params, [T], slot, [False], chunk_size, dt_limit=LIMIT)
    assert rel_err(y, want_y) < 1e-5 and rel_err(pool[3], want_h) < 1e-5
    pool = torch.randn(SLOTS, H, P, N, generator=gen)
    outs = [_call(pool, [t[s:e] for t in inp], params, [e - s], slot, [i > 0], chunk_size,
                  dt_limit=LIMIT) for i, (s, e) in enumerate(pieces(T))]
    assert rel_err(torch.cat(outs), want_y) < 1e-5 and rel_err(pool[3], want_h) < 1e-5


def test_dt_limit_changes_the_result():
    gen = torch.Generator().manual_seed(5)
    params, inp = _params(gen), _inputs(gen, 9)
    pool = torch.randn(SLOTS, H, P, N, generator=gen)
    one = torch.tensor([1], dtype=torch.int32)
    free = _call(pool, inp, params, [9], one, [False])
    clamped = _call(pool, inp, params, [9], one, [False], dt_limit=LIMIT)
    assert rel_err(free, _hf(*inp, params)[0]) < 1e-5
    assert rel_err(clamped, free) > 1e-3


def test_varlen_from_slot_states_matches_transformers():
    gen = torch.Generator().manual_seed(1)
    params = _params(gen)
    lengths, init = [11, 1, 19, 4], [True, False, True, True]
    inp = _inputs(gen, sum(lengths))
    z = torch.randn(sum(lengths), H, P, generator=gen)
    pool = torch.randn(SLOTS, H, P, N, generator=gen)
    before = pool.clone()
    slots = shuffled_slots(len(lengths), SLOTS, gen)
    y = _call(pool, inp, params, lengths, slots, init, chunk_size=8, z=z)
    start = 0
    for n, has, s in zip(lengths, init, slots.tolist()):
        part = [t[start:start + n] for t in inp]
        want_y, want_h = _hf(*part, params, h0=before[s] if has else None)
        want_y = want_y * torch.nn.functional.silu(z[start:start + n])  # the optional z gate
        assert rel_err(y[start:start + n], want_y) < 1e-5
        assert rel_err(pool[s], want_h) < 1e-5
        start += n
    assert untouched(before, pool, slots)


def test_return_states_at_equals_prefix_state():
    gen = torch.Generator().manual_seed(2)
    params = _params(gen)
    lengths = [33, 6]
    inp = _inputs(gen, sum(lengths))
    pool = torch.randn(SLOTS, H, P, N, generator=gen)
    before = pool.clone()
    slots = torch.tensor([5, 2], dtype=torch.int32)
    _, states = _call(pool, inp, params, lengths, slots, [True, False], 8, [[16, 32, 1], []])
    for pos, got in zip([16, 32, 1], states[0]):
        want = _hf(*[t[:pos] for t in inp], params, h0=before[5])[1]
        assert rel_err(got, want) < 1e-5
    assert states[1].shape == (0, H, P, N)


def _hf_step(state, x, dt, B, C, params):
    """transformers' Bamba decode step, with A/dt/D tied over head_dim exactly as BambaMixer does."""
    A, D, dt_bias = params
    return hf_step(state, x, dt[..., None].expand(-1, -1, P), A[:, None, None].expand(-1, P, N),
                   B, C, D[:, None].expand(-1, P), dt_bias=dt_bias[:, None].expand(-1, P),
                   dt_softplus=True)


def test_decode_step_matches_transformers():
    gen = torch.Generator().manual_seed(3)
    params = _params(gen)
    x, dt, B, C = _inputs(gen, 3)
    pool = torch.randn(SLOTS, H, P, N, generator=gen)
    before = pool.clone()
    slots = shuffled_slots(3, SLOTS, gen)
    A, D, dt_bias = params
    y = mamba2_state_update_ref(pool, x, dt, A, B, C, D, None, dt_bias, slots, True)
    state = before[slots.long()].clone()
    want = _hf_step(state, x, dt, B, C, params)
    assert rel_err(y, want) < 1e-6 and rel_err(pool[slots.long()], state) < 1e-6
    assert untouched(before, pool, slots)


def test_decode_steps_continue_a_prefill():
    gen = torch.Generator().manual_seed(4)
    params = _params(gen)
    inp = _inputs(gen, 14)
    pool = torch.randn(SLOTS, H, P, N, generator=gen)
    slot = torch.tensor([6], dtype=torch.int32)
    want_y, want_h = _hf(*inp, params)
    ys = [_call(pool, [t[:10] for t in inp], params, [10], slot, [False])]
    A, D, dt_bias = params
    for t in range(10, 14):
        x, dt, B, C = (u[t:t + 1] for u in inp)
        ys.append(mamba2_state_update_ref(pool, x, dt, A, B, C, D, None, dt_bias, slot, True))
    assert rel_err(torch.cat(ys), want_y) < 1e-5 and rel_err(pool[6], want_h) < 1e-5


# ---- Triton step kernel against the reference (TRITON_INTERPRET=1 on CPU) ----

TOL = {torch.float32: 1e-4, torch.float16: 2e-3}


@pytest.mark.slow  # interpreted Triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("variant", ["gated_limited", "plain"])
def test_triton_step_matches_reference(dtype, variant):
    from hybridkv.kernels.mamba2 import mamba2_state_update_triton

    gen = torch.Generator().manual_seed(30)
    A, D, dt_bias = _params(gen)
    x, dt, B, C = (t.to(dtype) for t in _inputs(gen, 5))
    full = variant == "gated_limited"
    z = torch.randn(5, H, P, generator=gen).to(dtype) if full else None
    kw = dict(dt_limit=LIMIT) if full else {}
    pool = torch.randn(SLOTS, H, P, N, generator=gen)  # fp32 states beside fp16 inputs
    before, ref_pool = pool.clone(), pool.clone()
    slots = shuffled_slots(5, SLOTS, gen)
    bias, skip = (dt_bias, D) if full else (None, None)
    want = mamba2_state_update_ref(ref_pool, x, dt, A, B, C, skip, z, bias, slots, True, **kw)
    got = mamba2_state_update_triton(pool, x, dt, A, B, C, skip, z, bias, slots, True, **kw)
    assert got.dtype == dtype
    assert rel_err(got, want) < TOL[dtype] and rel_err(pool, ref_pool) < TOL[dtype]
    assert untouched(before, pool, slots)


@pytest.mark.slow  # interpreted Triton
def test_public_api_passes_dt_limit_to_both_backends(monkeypatch):
    import hybridkv.kernels as hk

    gen = torch.Generator().manual_seed(31)
    A, D, dt_bias = _params(gen)
    x, dt, B, C = _inputs(gen, 2)
    res = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("HYBRIDKV_BACKEND", backend)
        pool = torch.randn(SLOTS, H, P, N, generator=torch.Generator().manual_seed(32))
        y = hk.mamba2_state_update(pool, x, dt * 3, A, B, C, D, None, dt_bias,
                                   torch.tensor([2, 5], dtype=torch.int32), dt_limit=LIMIT)
        res[backend] = (y, pool)
    want = mamba2_state_update_ref(
        torch.randn(SLOTS, H, P, N, generator=torch.Generator().manual_seed(32)), x, dt * 3, A, B,
        C, D, None, dt_bias, torch.tensor([2, 5], dtype=torch.int32), True, dt_limit=LIMIT)
    for y, pool in res.values():
        assert rel_err(y, want) < 1e-4
    assert rel_err(res["triton"][1], res["torch"][1]) < 1e-4
