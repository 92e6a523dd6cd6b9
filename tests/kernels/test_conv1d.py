"""causal conv1d over state slots: the torch reference against transformers' own conv functions,
and the Triton kernels against the reference."""
import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as qn

from hybridkv.kernels.conv1d_ref import causal_conv1d_ref, conv1d_update_ref
from state_kernel_helpers import pieces, qsl, rel_err, shuffled_slots, torch_path, untouched

hf_conv_fn = torch_path(qn.causal_conv1d_fn)
hf_conv_update = torch_path(qn.causal_conv1d_update)

DIM, K, SLOTS = 12, 4, 7


def _params(gen, dim=DIM, k=K, bias=True):
    w = torch.randn(dim, k, generator=gen)
    b = torch.randn(dim, generator=gen) if bias else None
    return w, b


def _hf_from_state(x, window, w, b, act):
    """transformers' conv over [window, x] for one request: x [L, dim], window [dim, k-1]."""
    state = window.clone().unsqueeze(0)
    y = hf_conv_update(x.t().unsqueeze(0).contiguous(), state, w, b, activation=act)
    return y[0].t(), state[0]


@pytest.mark.parametrize("act", ["silu", None])
@pytest.mark.parametrize("bias", [True, False])
def test_one_pass_matches_transformers(act, bias):
    gen = torch.Generator().manual_seed(0)
    w, b = _params(gen, bias=bias)
    x = torch.randn(23, DIM, generator=gen)
    pool = torch.randn(SLOTS, DIM, K - 1, generator=gen)
    y = causal_conv1d_ref(x, pool, w, b, qsl([23]), torch.tensor([3], dtype=torch.int32),
                          torch.tensor([False]), act)
    want = hf_conv_fn(x.t().unsqueeze(0), w, b, activation=act)[0].t()
    assert rel_err(y, want) < 1e-6
    assert torch.equal(pool[3], x[-(K - 1):].t())  # the slot keeps the raw last inputs


def test_chunked_through_slot_equals_one_pass():
    gen = torch.Generator().manual_seed(1)
    w, b = _params(gen)
    x = torch.randn(40, DIM, generator=gen)
    pool = torch.randn(SLOTS, DIM, K - 1, generator=gen)
    slot = torch.tensor([5], dtype=torch.int32)
    outs = []
    for i, (s, e) in enumerate(pieces(40, sizes=(5, 16, 1, 2, 7))):  # pieces of 1 and 2 < k-1
        outs.append(causal_conv1d_ref(x[s:e], pool, w, b, qsl([e - s]), slot,
                                      torch.tensor([i > 0]), "silu"))
    want = hf_conv_fn(x.t().unsqueeze(0), w, b, activation="silu")[0].t()
    assert rel_err(torch.cat(outs), want) < 1e-6
    assert torch.equal(pool[5], x[-(K - 1):].t())


def test_varlen_packing_with_and_without_history():
    gen = torch.Generator().manual_seed(2)
    w, b = _params(gen)
    lengths, init = [6, 1, 2, 9], [True, False, True, True]
    x = torch.randn(sum(lengths), DIM, generator=gen)
    pool = torch.randn(SLOTS, DIM, K - 1, generator=gen)
    before = pool.clone()
    slots = shuffled_slots(len(lengths), SLOTS, gen)
    y = causal_conv1d_ref(x, pool, w, b, qsl(lengths), slots, torch.tensor(init), "silu")
    start = 0
    for n, has, s in zip(lengths, init, slots.tolist()):
        window = before[s] if has else torch.zeros(DIM, K - 1)
        want_y, want_state = _hf_from_state(x[start:start + n], window, w, b, "silu")
        assert rel_err(y[start:start + n], want_y) < 1e-6
        assert torch.equal(pool[s], want_state)  # a 1- or 2-token request shifts the old window
        start += n
    assert untouched(before, pool, slots)


DECODE_SLOTS = {  # scattered: gather + write back; one range, sorted or not: shifted in place
    "scattered": lambda gen: shuffled_slots(4, SLOTS, gen),
    "range": lambda gen: torch.tensor([2, 3, 4, 5], dtype=torch.int32),
    "range_shuffled": lambda gen: torch.tensor([4, 2, 5, 3], dtype=torch.int32),
    "range_with_hole": lambda gen: torch.tensor([6, 2, 4, 3], dtype=torch.int32),
}


@pytest.mark.parametrize("layout", DECODE_SLOTS)
@pytest.mark.parametrize("k", [2, 4])
def test_decode_update_matches_transformers(layout, k):
    gen = torch.Generator().manual_seed(3)
    w, b = _params(gen, k=k)
    pool = torch.randn(SLOTS, DIM, k - 1, generator=gen)
    slots = DECODE_SLOTS[layout](gen)
    before = pool.clone()
    x = torch.randn(4, DIM, generator=gen)
    y = conv1d_update_ref(x, pool, w, b, slots, "silu")
    state = before[slots.long()].clone()
    want = hf_conv_update(x.unsqueeze(-1), state, w, b, activation="silu")[..., 0]
    assert rel_err(y, want) < 1e-6
    assert torch.equal(pool[slots.long()], state)
    assert untouched(before, pool, slots)


# ---- Triton kernels against the reference (TRITON_INTERPRET=1 on CPU) ----

TOL = {torch.float32: 1e-4, torch.float16: 2e-3}


@pytest.mark.slow  # interpreted Triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_prefill_matches_reference(dtype):
    from hybridkv.kernels.conv1d import causal_conv1d_triton

    gen = torch.Generator().manual_seed(10)
    dim = 20  # not a power of two: the channel mask matters
    w, b = _params(gen, dim=dim)
    w = w.to(dtype)
    lengths, init = [1, 18, 2, 5], [True, True, False, True]
    x = torch.randn(sum(lengths), dim, generator=gen).to(dtype)
    pool = torch.randn(SLOTS, dim, K - 1, generator=gen)  # fp32 states beside fp16 inputs
    slots = shuffled_slots(len(lengths), SLOTS, gen)
    before, ref_pool = pool.clone(), pool.clone()
    args = (qsl(lengths), slots, torch.tensor(init))
    want = causal_conv1d_ref(x, ref_pool, w, b, *args, "silu")
    got = causal_conv1d_triton(x, pool, w, b, *args, "silu")
    assert got.dtype == dtype
    assert rel_err(got, want) < TOL[dtype]
    assert rel_err(pool, ref_pool) < TOL[dtype]
    assert untouched(before, pool, slots)


@pytest.mark.slow  # interpreted Triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_decode_matches_reference(dtype):
    from hybridkv.kernels.conv1d import conv1d_update_triton

    gen = torch.Generator().manual_seed(11)
    w, _ = _params(gen)
    pool = torch.randn(SLOTS, DIM, K - 1, generator=gen).to(dtype)
    before = pool.clone()
    slots = shuffled_slots(5, SLOTS, gen)
    x = torch.randn(5, DIM, generator=gen).to(dtype)
    ref_pool = pool.clone()
    want = conv1d_update_ref(x, ref_pool, w, None, slots, None)
    got = conv1d_update_triton(x, pool, w, None, slots, None)
    assert rel_err(got, want) < TOL[dtype]
    assert torch.equal(pool, ref_pool)  # the window shift is a pure copy
    assert untouched(before, pool, slots)


@pytest.mark.slow  # interpreted Triton
def test_public_api_runs_both_backends(monkeypatch):
    import hybridkv.kernels as hk

    gen = torch.Generator().manual_seed(12)
    w, b = _params(gen)
    x = torch.randn(9, DIM, generator=gen)
    pools = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("HYBRIDKV_BACKEND", backend)
        pool = torch.randn(SLOTS, DIM, K - 1, generator=torch.Generator().manual_seed(13))
        y = hk.causal_conv1d(x[:8], pool, w, b, qsl([3, 5]), torch.tensor([4, 2], dtype=torch.int32),
                             torch.tensor([True, False]))
        y2 = hk.conv1d_update(x[8:], pool, w, b, torch.tensor([4], dtype=torch.int32))
        pools[backend] = (torch.cat([y, y2]), pool)
    assert rel_err(pools["triton"][0], pools["torch"][0]) < 1e-4
    assert rel_err(pools["triton"][1], pools["torch"][1]) < 1e-4
