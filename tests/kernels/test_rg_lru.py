"""RG-LRU over state slots (kernels/rg_lru_ref.py) against transformers' RecurrentGemmaRglru module
on random inputs: one pass, chunks resumed from slots, states at chosen positions, decode steps."""
import pytest
import torch
from transformers import RecurrentGemmaConfig
from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru

from hybridkv.kernels.rg_lru_ref import rg_lru_scan_ref, rg_lru_state_update_ref
from state_kernel_helpers import pieces, qsl, rel_err, shuffled_slots, untouched

W, HEADS, SLOTS = 12, 3, 7


def _hf_lru(seed: int) -> RecurrentGemmaRglru:
    gen = torch.Generator().manual_seed(seed)
    lru = RecurrentGemmaRglru(RecurrentGemmaConfig(hidden_size=W, lru_width=W, num_attention_heads=HEADS))
    with torch.no_grad():
        for p in lru.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.7)
    return lru


def _gates(lru, x):
    """x [T, W] -> the module's sigmoid'ed input and recurrence gates [T, W] (block-diagonal)."""
    per_head = x.view(-1, HEADS, W // HEADS)
    gi = torch.einsum("thi,hij->thj", per_head, lru.input_gate_weight) + lru.input_gate_bias
    gr = torch.einsum("thi,hij->thj", per_head, lru.recurrent_gate_weight) + lru.recurrent_gate_bias
    return torch.sigmoid(gi).reshape(x.shape), torch.sigmoid(gr).reshape(x.shape)


@torch.no_grad()
def _hf_run(lru, x, start_pos=0, state=None):
    """transformers' module over x [L, W] at positions start_pos.. from `state` [W] (None: fresh)
    -> (y [L, W], final state [W]); one token at a time after position 0 is its decode mode."""
    lru.recurrent_states = None if state is None else state[None].clone()
    pos = torch.arange(start_pos, start_pos + x.shape[0])[None]
    y = lru(x[None], pos)[0]
    return y, lru.recurrent_states[0]


@torch.no_grad()
def test_one_pass_chunks_and_states_at_positions_match_transformers():
    lru, gen = _hf_lru(0), torch.Generator().manual_seed(1)
    T = 37
    x = torch.randn(T, W, generator=gen)
    gi, gr = _gates(lru, x)
    want_y, want_h = _hf_run(lru, x)
    pool = torch.randn(SLOTS, W, generator=gen)  # garbage a fresh request must ignore
    slot = shuffled_slots(1, SLOTS, gen)
    before = pool.clone()
    y, states = rg_lru_scan_ref(pool, x, gi, gr, lru.recurrent_param, qsl([T]), slot,
                                torch.tensor([False]), return_states_at=[[1, 16, 20]])
    assert rel_err(y, want_y) < 1e-5 and rel_err(pool[slot.long()][0], want_h) < 1e-5
    assert untouched(before, pool, slot)
    for i, p in enumerate((1, 16, 20)):  # the state there = transformers run on the prefix alone
        assert rel_err(states[0][i], _hf_run(lru, x[:p])[1]) < 1e-5

    # the same tokens in uneven chunks, each resuming from the slot's state
    pool2 = torch.randn(SLOTS, W, generator=gen)
    got = []
    for a, b in pieces(T):
        got.append(rg_lru_scan_ref(pool2, x[a:b], gi[a:b], gr[a:b], lru.recurrent_param,
                                   qsl([b - a]), slot, torch.tensor([a > 0])))
    assert rel_err(torch.cat(got), want_y) < 1e-5


@torch.no_grad()
def test_ragged_requests_and_decode_steps_match_transformers():
    """Two requests in one call (one fresh, one resuming a state), then decode steps of both
    through the one-token update: each equals transformers' own run."""
    lru, gen = _hf_lru(2), torch.Generator().manual_seed(3)
    lens = [9, 14]
    xs = [torch.randn(n, W, generator=gen) for n in lens]
    h0 = torch.randn(W, generator=gen)
    pool = torch.randn(SLOTS, W, generator=gen)
    slots = shuffled_slots(2, SLOTS, gen)
    pool[slots[1].long()] = h0
    x = torch.cat(xs)
    gi, gr = _gates(lru, x)
    y = rg_lru_scan_ref(pool, x, gi, gr, lru.recurrent_param, qsl(lens), slots, torch.tensor([False, True]))
    want0, h_a = _hf_run(lru, xs[0])
    want1, h_b = _hf_run(lru, xs[1], start_pos=5, state=h0)
    assert rel_err(y[:9], want0) < 1e-5 and rel_err(y[9:], want1) < 1e-5
    for step in range(4):
        xd = torch.randn(2, W, generator=gen)
        gi, gr = _gates(lru, xd)
        yd = rg_lru_state_update_ref(pool, xd, gi, gr, lru.recurrent_param, slots)
        ya, h_a = _hf_run(lru, xd[:1], start_pos=9 + step, state=h_a)
        yb, h_b = _hf_run(lru, xd[1:], start_pos=19 + step, state=h_b)
        assert rel_err(yd, torch.cat([ya, yb])) < 1e-5
    assert rel_err(pool[slots.long()], torch.stack([h_a, h_b])) < 1e-5


def test_bad_widths_are_refused_and_change_nothing():
    gen = torch.Generator().manual_seed(4)
    pool = torch.randn(SLOTS, W, generator=gen)
    before = pool.clone()
    x = torch.randn(3, W + 1, generator=gen)
    with pytest.raises(ValueError, match=f"x has width {W + 1} but the RG-LRU state pool has {W}"):
        rg_lru_state_update_ref(pool, x, x, x, torch.randn(W), torch.tensor([1, 2, 3]))
    x = torch.randn(3, W, generator=gen)
    with pytest.raises(ValueError, match="slot index 9 is outside the state pool of 7 slots"):
        rg_lru_scan_ref(pool, x, x, x, torch.randn(W), qsl([3]), torch.tensor([9]), torch.tensor([True]))
    assert torch.equal(pool, before)


# ---- Triton decode step against the reference (TRITON_INTERPRET=1 on CPU) ----

@pytest.mark.slow  # interpreted Triton
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_triton_step_matches_reference(dtype, tol):
    from hybridkv.kernels.rg_lru_kernel import rg_lru_state_update_triton

    gen = torch.Generator().manual_seed(5)
    B = 4
    x = torch.randn(B, W, generator=gen).to(dtype)
    gi, gr = (torch.rand(B, W, generator=gen).to(dtype) for _ in range(2))
    param = torch.randn(W, generator=gen)
    pool = torch.randn(SLOTS, W, generator=gen)  # float32 states beside fp16 inputs
    before, ref_pool = pool.clone(), pool.clone()
    slots = shuffled_slots(B, SLOTS, gen)
    want = rg_lru_state_update_ref(ref_pool, x, gi, gr, param, slots)
    got = rg_lru_state_update_triton(pool, x, gi, gr, param, slots)
    assert got.dtype == dtype
    assert rel_err(got, want) < tol and rel_err(pool, ref_pool) < 1e-5
    assert untouched(before, pool, slots)
    after = pool.clone()
    with pytest.raises(ValueError, match="recurrent_gate has width 5"):
        rg_lru_state_update_triton(pool, x, gi, gr[:, :5], param, slots)
    assert torch.equal(pool, after)  # refused: nothing written


@pytest.mark.slow  # interpreted Triton
def test_dispatcher_runs_both_backends(monkeypatch):
    from hybridkv.kernels.ops import rg_lru_state_update

    gen = torch.Generator().manual_seed(6)
    x, gi, gr = torch.randn(2, W, generator=gen), torch.rand(2, W, generator=gen), torch.rand(2, W, generator=gen)
    param = torch.randn(W, generator=gen)
    res = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("HYBRIDKV_BACKEND", backend)
        pool = torch.randn(SLOTS, W, generator=torch.Generator().manual_seed(7))
        res[backend] = (rg_lru_state_update(pool, x, gi, gr, param, torch.tensor([3, 1], dtype=torch.int32)), pool)
    assert rel_err(res["triton"][0], res["torch"][0]) < 1e-5
    assert rel_err(res["triton"][1], res["torch"][1]) < 1e-5
