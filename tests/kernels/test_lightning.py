"""Lightning attention over state slots: the torch reference against transformers' MiniMax
lightning attention (its block-chunked prefill and its token-by-token decode), and the Triton
step kernel against the reference."""
import pytest
import torch
from torch import nn
from transformers import MiniMaxConfig
from transformers.models.minimax import modeling_minimax as mm

from hybridkv.kernels.lightning_ref import lightning_chunk_scan_ref, lightning_state_update_ref
from state_kernel_helpers import pieces, qsl, rel_err, shuffled_slots, untouched

H, D, SLOTS, LAYER = 4, 8, 7, 1


def _hf_core(gen):
    """transformers' MiniMaxLightningAttention whose norm and out_proj are identities and whose
    output gate is sigmoid(0) = 1/2: its output is half the attention core, exactly."""
    cfg = MiniMaxConfig(hidden_size=32, num_attention_heads=H, head_dim=D, num_hidden_layers=4,
                        block_size=8, layer_types=["linear_attention"] * 4)
    m = mm.MiniMaxLightningAttention(cfg, LAYER).eval()
    with torch.no_grad():
        m.qkv_proj.weight.copy_(torch.randn(m.qkv_proj.weight.shape, generator=gen) * 0.3)
        m.output_gate.weight.zero_()
    m.norm, m.out_proj = nn.Identity(), nn.Identity()
    return m


def _qkv(m, hidden):
    """The activated q, k, v [T, H, D] the module computes from hidden [T, 32]."""
    qkv = torch.nn.functional.silu(m.qkv_proj(hidden)).view(hidden.shape[0], H, 3 * D)
    return torch.split(qkv, D, dim=-1)


@torch.no_grad()
def _hf(m, hidden, h0=None):
    """(core o [L, H, D], final state [H, D, D]): the chunked path from zeros, or with `h0` the
    cached path, which runs token by token."""
    cache = None
    if h0 is not None:
        cache = mm.MiniMaxCache()
        cache.set_linear_cache(LAYER, h0[None].clone())
    out, state = m(hidden[None], None, None, cache=cache)
    return 2 * out[0].view(-1, H, D), state[0]


@pytest.fixture
def setup():
    gen = torch.Generator().manual_seed(0)
    m = _hf_core(gen)
    return m, m.slope_rate.view(H).clone(), gen


@torch.no_grad()
@pytest.mark.parametrize("chunk_size", [4, 16])
def test_one_pass_and_pieces_match_transformers(setup, chunk_size):
    m, slope, gen = setup
    T = 35  # 5 of transformers' 8-token blocks, the last one short
    hidden = torch.randn(T, 32, generator=gen)
    want_o, want_s = _hf(m, hidden)
    q, k, v = _qkv(m, hidden)
    pool = torch.randn(SLOTS, H, D, D, generator=gen)
    slot = torch.tensor([2], dtype=torch.int32)
    o = lightning_chunk_scan_ref(pool, q, k, v, slope, qsl([T]), slot, torch.tensor([False]),
                                 chunk_size)
    assert rel_err(o, want_o) < 1e-5 and rel_err(pool[2], want_s) < 1e-5
    pool = torch.randn(SLOTS, H, D, D, generator=gen)
    outs = [lightning_chunk_scan_ref(pool, q[s:e], k[s:e], v[s:e], slope, qsl([e - s]), slot,
                                     torch.tensor([i > 0]), chunk_size)
            for i, (s, e) in enumerate(pieces(T))]
    assert rel_err(torch.cat(outs), want_o) < 1e-5 and rel_err(pool[2], want_s) < 1e-5


@torch.no_grad()
def test_varlen_from_slot_states_matches_transformers(setup):
    m, slope, gen = setup
    lengths, init = [9, 1, 17, 3], [True, False, True, True]
    hidden = torch.randn(sum(lengths), 32, generator=gen)
    q, k, v = _qkv(m, hidden)
    pool = torch.randn(SLOTS, H, D, D, generator=gen)
    before = pool.clone()
    slots = shuffled_slots(len(lengths), SLOTS, gen)
    o = lightning_chunk_scan_ref(pool, q, k, v, slope, qsl(lengths), slots, torch.tensor(init), 8)
    start = 0
    for n, has, s in zip(lengths, init, slots.tolist()):
        want_o, want_s = _hf(m, hidden[start:start + n], before[s] if has else None)
        assert rel_err(o[start:start + n], want_o) < 1e-5
        assert rel_err(pool[s], want_s) < 1e-5
        start += n
    assert untouched(before, pool, slots)


@torch.no_grad()
def test_return_states_at_equals_prefix_state(setup):
    m, slope, gen = setup
    lengths = [5, 30]
    hidden = torch.randn(sum(lengths), 32, generator=gen)
    q, k, v = _qkv(m, hidden)
    pool = torch.randn(SLOTS, H, D, D, generator=gen)
    slots = torch.tensor([6, 1], dtype=torch.int32)
    _, states = lightning_chunk_scan_ref(pool, q, k, v, slope, qsl(lengths), slots,
                                         torch.tensor([False, False]), 8, [[5], [16, 3, 30]])
    for pos, got in zip([16, 3, 30], states[1]):
        assert rel_err(got, _hf(m, hidden[5:5 + pos])[1]) < 1e-5
    assert torch.equal(states[0][0], pool[6]) and torch.equal(states[1][2], pool[1])


@torch.no_grad()
def test_decode_step_matches_transformers(setup):
    m, slope, gen = setup
    hidden = torch.randn(3, 32, generator=gen)
    q, k, v = _qkv(m, hidden)
    pool = torch.randn(SLOTS, H, D, D, generator=gen)
    before = pool.clone()
    slots = shuffled_slots(3, SLOTS, gen)
    o = lightning_state_update_ref(pool, q, k, v, slope, slots)
    for b, s in enumerate(slots.tolist()):
        want_o, want_s = _hf(m, hidden[b:b + 1], before[s])
        assert rel_err(o[b], want_o[0]) < 1e-6 and rel_err(pool[s], want_s) < 1e-6
    assert untouched(before, pool, slots)


@torch.no_grad()
def test_decode_steps_continue_a_prefill(setup):
    m, slope, gen = setup
    hidden = torch.randn(12, 32, generator=gen)
    q, k, v = _qkv(m, hidden)
    want_o, want_s = _hf(m, hidden)
    pool = torch.randn(SLOTS, H, D, D, generator=gen)
    slot = torch.tensor([4], dtype=torch.int32)
    outs = [lightning_chunk_scan_ref(pool, q[:9], k[:9], v[:9], slope, qsl([9]), slot,
                                     torch.tensor([False]))]
    for t in range(9, 12):
        outs.append(lightning_state_update_ref(pool, q[t:t + 1], k[t:t + 1], v[t:t + 1], slope, slot))
    assert rel_err(torch.cat(outs), want_o) < 1e-5 and rel_err(pool[4], want_s) < 1e-5


def test_bad_shapes_are_refused_and_change_nothing():
    pool = torch.randn(SLOTS, H, D, D)
    before = pool.clone()
    q = torch.randn(2, H, D)
    with pytest.raises(ValueError, match=r"slope has shape \(3,\)"):
        lightning_state_update_ref(pool, q, q, q, torch.rand(3), torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="do not fit the state pool"):
        lightning_state_update_ref(pool, q, q, torch.randn(2, H, D + 1), torch.rand(H),
                                   torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="chunk_size must be positive, got 0"):
        lightning_chunk_scan_ref(pool, q, q, q, torch.rand(H), qsl([2]),
                                 torch.tensor([1], dtype=torch.int32), torch.tensor([True]), 0)
    assert torch.equal(pool, before)


# ---- Triton step kernel against the reference (TRITON_INTERPRET=1 on CPU) ----

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.mark.slow  # interpreted Triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_step_matches_reference(dtype):
    from hybridkv.kernels.lightning import lightning_state_update_triton

    gen = torch.Generator().manual_seed(40)
    k_dim, v_dim, heads = 12, 20, 3  # not powers of two: the masks matter
    q, k = (torch.randn(5, heads, k_dim, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(5, heads, v_dim, generator=gen).to(dtype)
    slope = torch.rand(heads, generator=gen) * 0.5 + 0.01
    for pool_dtype in (torch.float32, dtype):  # fp32 states beside fp16 inputs, and the model dtype
        pool = torch.randn(SLOTS, heads, k_dim, v_dim, generator=gen).to(pool_dtype)
        before, ref_pool = pool.clone(), pool.clone()
        slots = shuffled_slots(5, SLOTS, gen)
        want = lightning_state_update_ref(ref_pool, q, k, v, slope, slots)
        got = lightning_state_update_triton(pool, q, k, v, slope, slots)
        assert got.dtype == dtype
        assert rel_err(got, want) < TOL[dtype] and rel_err(pool, ref_pool) < TOL[dtype]
        assert untouched(before, pool, slots)


@pytest.mark.slow  # interpreted Triton
def test_public_api_runs_both_backends(monkeypatch):
    import hybridkv.kernels as hk

    gen = torch.Generator().manual_seed(41)
    q, k, v = (torch.randn(2, H, D, generator=gen) for _ in range(3))
    slope = torch.rand(H, generator=gen)
    res = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("HYBRIDKV_BACKEND", backend)
        pool = torch.randn(SLOTS, H, D, D, generator=torch.Generator().manual_seed(42))
        o = hk.lightning_state_update(pool, q, k, v, slope, torch.tensor([6, 3], dtype=torch.int32))
        res[backend] = (o, pool)
    assert rel_err(res["triton"][0], res["torch"][0]) < 1e-5
    assert rel_err(res["triton"][1], res["torch"][1]) < 1e-5
