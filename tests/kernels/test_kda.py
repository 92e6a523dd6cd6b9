"""Kimi delta attention over state slots: the torch reference against transformers' KimiLinear torch
functions (chunked and recurrent), and the Triton step kernel against the reference."""
import pytest
import torch
import torch.nn.functional as F
from transformers.models.kimi_linear import modeling_kimi_linear as kl

from hybridkv.kernels.kda_ref import kda_chunk_scan_ref, kda_state_update_ref
from state_kernel_helpers import pieces, qsl, rel_err, shuffled_slots, torch_path, untouched

hf_chunk = torch_path(kl.chunk_kimi_delta_attention)
hf_recurrent = torch_path(kl.recurrent_kimi_delta_attention)

H, K, V, SLOTS = 3, 8, 6, 7


def _inputs(gen, T, k_dim=K, v_dim=V):
    q = torch.randn(T, H, k_dim, generator=gen)
    k = torch.randn(T, H, k_dim, generator=gen)
    v = torch.randn(T, H, v_dim, generator=gen)
    # per-channel log-decay as KimiLinearForgetGate computes it: -exp(A_log) * softplus(.)
    A_log = torch.randn(1, H, 1, generator=gen) * 0.5
    g = -A_log.exp() * F.softplus(torch.randn(T, H, k_dim, generator=gen) - 1.0)
    beta = torch.randn(T, H, generator=gen).sigmoid()
    return q, k, v, g, beta


def _hf(q, k, v, g, beta, h0=None, chunk_size=8):
    """transformers' chunked KDA for one request: (o [L, H, V], state [H, K, V])."""
    o, s = hf_chunk(q[None], k[None], v[None], g=g[None], beta=beta[None], chunk_size=chunk_size,
                    initial_state=None if h0 is None else h0[None].clone(),
                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    return o[0], s[0]


def _call(pool, inp, lengths, slots, init, chunk_size=16, return_states_at=None):
    q, k, v, g, beta = inp
    return kda_chunk_scan_ref(pool, q, k, v, g, beta, qsl(lengths), slots, torch.tensor(init),
                              None, True, chunk_size, return_states_at)


@pytest.mark.parametrize("chunk_size", [4, 16])
def test_one_pass_and_pieces_match_transformers(chunk_size):
    gen = torch.Generator().manual_seed(0)
    T = 35
    inp = _inputs(gen, T)
    want_o, want_s = _hf(*inp)
    pool = torch.randn(SLOTS, H, K, V, generator=gen)
    slot = torch.tensor([2], dtype=torch.int32)
    o = _call(pool, inp, [T], slot, [False], chunk_size)
    assert rel_err(o, want_o) < 1e-5 and rel_err(pool[2], want_s) < 1e-5
    pool = torch.randn(SLOTS, H, K, V, generator=gen)
    outs = [_call(pool, [t[s:e] for t in inp], [e - s], slot, [i > 0], chunk_size)
            for i, (s, e) in enumerate(pieces(T))]
    assert rel_err(torch.cat(outs), want_o) < 1e-5 and rel_err(pool[2], want_s) < 1e-5


def test_varlen_from_slot_states_matches_transformers():
    gen = torch.Generator().manual_seed(1)
    lengths, init = [9, 1, 17, 3], [True, False, True, True]
    inp = _inputs(gen, sum(lengths))
    pool = torch.randn(SLOTS, H, K, V, generator=gen) * 0.3
    before = pool.clone()
    slots = shuffled_slots(len(lengths), SLOTS, gen)
    o = _call(pool, inp, lengths, slots, init, chunk_size=8)
    start = 0
    for n, has, s in zip(lengths, init, slots.tolist()):
        part = [t[start:start + n] for t in inp]
        want_o, want_s = _hf(*part, h0=before[s] if has else None, chunk_size=4)
        assert rel_err(o[start:start + n], want_o) < 1e-5
        assert rel_err(pool[s], want_s) < 1e-5
        start += n
    assert untouched(before, pool, slots)


def test_return_states_at_equals_prefix_state():
    gen = torch.Generator().manual_seed(2)
    lengths = [5, 30]
    inp = _inputs(gen, sum(lengths))
    pool = torch.randn(SLOTS, H, K, V, generator=gen)
    slots = torch.tensor([6, 1], dtype=torch.int32)
    _, states = _call(pool, inp, lengths, slots, [False, False], 8, [[5], [16, 3, 30]])
    for pos, got in zip([16, 3, 30], states[1]):
        assert rel_err(got, _hf(*[t[5:5 + pos] for t in inp])[1]) < 1e-5
    assert torch.equal(states[0][0], pool[6])


def test_decode_step_matches_transformers():
    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta = _inputs(gen, 4)
    pool = torch.randn(SLOTS, H, K, V, generator=gen)
    before = pool.clone()
    slots = shuffled_slots(4, SLOTS, gen)
    o = kda_state_update_ref(pool, q, k, v, g, beta, slots)
    want_o, want_s = hf_recurrent(q[:, None], k[:, None], v[:, None], g=g[:, None],
                                  beta=beta[:, None], initial_state=before[slots.long()].clone(),
                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert rel_err(o, want_o[:, 0]) < 1e-6 and rel_err(pool[slots.long()], want_s) < 1e-6
    assert untouched(before, pool, slots)


def test_decode_steps_continue_a_prefill():
    gen = torch.Generator().manual_seed(4)
    inp = _inputs(gen, 12)
    pool = torch.randn(SLOTS, H, K, V, generator=gen)
    slot = torch.tensor([4], dtype=torch.int32)
    want_o, want_s = _hf(*inp)
    outs = [_call(pool, [t[:9] for t in inp], [9], slot, [False])]
    for t in range(9, 12):
        q, k, v, g, beta = (u[t:t + 1] for u in inp)
        outs.append(kda_state_update_ref(pool, q, k, v, g, beta, slot))
    assert rel_err(torch.cat(outs), want_o) < 1e-5 and rel_err(pool[4], want_s) < 1e-5


def test_bad_shapes_are_refused_and_change_nothing():
    gen = torch.Generator().manual_seed(5)
    q, k, v, g, beta = _inputs(gen, 2)
    pool = torch.randn(SLOTS, H, K, V, generator=gen)
    before = pool.clone()
    slots = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"g \(2, 3\)"):
        kda_state_update_ref(pool, q, k, v, g[..., 0], beta, slots)  # a per-head gate is GDN's
    with pytest.raises(ValueError, match="chunk_size must be positive, got 0"):
        kda_chunk_scan_ref(pool, q, k, v, g, beta, qsl([2]), slots[:1], torch.tensor([True]),
                           chunk_size=0)
    assert torch.equal(pool, before)


# ---- Triton step kernel against the reference (TRITON_INTERPRET=1 on CPU) ----

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("l2norm", [True, False])
def test_triton_step_matches_reference(dtype, l2norm):
    from hybridkv.kernels.kda import kda_state_update_triton

    gen = torch.Generator().manual_seed(40)
    k_dim, v_dim = 12, 20  # not powers of two: the masks matter
    q, k, v, g, beta = _inputs(gen, 5, k_dim, v_dim)
    if not l2norm:
        k = k * 0.3
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    pool = torch.randn(SLOTS, H, k_dim, v_dim, generator=gen)  # fp32 states beside fp16 inputs
    before, ref_pool = pool.clone(), pool.clone()
    slots = shuffled_slots(5, SLOTS, gen)
    scale = None if l2norm else 0.2
    want = kda_state_update_ref(ref_pool, q, k, v, g, beta, slots, scale, l2norm)
    got = kda_state_update_triton(pool, q, k, v, g, beta, slots, scale, l2norm)
    assert got.dtype == dtype
    assert rel_err(got, want) < TOL[dtype] and rel_err(pool, ref_pool) < TOL[dtype]
    assert untouched(before, pool, slots)


def test_public_api_runs_both_backends(monkeypatch):
    import hybridkv.kernels as hk

    gen = torch.Generator().manual_seed(41)
    q, k, v, g, beta = _inputs(gen, 2)
    res = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("HYBRIDKV_BACKEND", backend)
        pool = torch.randn(SLOTS, H, K, V, generator=torch.Generator().manual_seed(42))
        o = hk.kda_state_update(pool, q, k, v, g, beta, torch.tensor([6, 3], dtype=torch.int32))
        res[backend] = (o, pool)
    assert rel_err(res["triton"][0], res["torch"][0]) < 1e-5
    assert rel_err(res["triton"][1], res["torch"][1]) < 1e-5
