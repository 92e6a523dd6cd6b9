"""The packed CPU causal conv and the in-place decode conv (kernels/causal_conv_cpu.py) against
the reference (kernels/conv1d_ref.py), random inputs, ragged requests, runs of slots; the prefill
runs on the C kernel and on the torch path (tests/prefill_paths.py)."""
import pytest
import torch

from hybridkv.kernels.causal_conv_cpu import causal_conv1d_cpu, conv1d_update_cpu
from hybridkv.kernels.conv1d_ref import causal_conv1d_ref, conv1d_update_ref
from prefill_paths import prefill_path  # noqa: F401 (fixture)
from state_kernel_helpers import qsl, rel_err, untouched

DIM, SLOTS = 10, 12


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("bias, act", [(True, "silu"), (False, None)])
def test_prefill_matches_reference(k, bias, act, prefill_path):
    gen = torch.Generator().manual_seed(k)
    # requests shorter than the window (1), with and without a window
    lengths, init = [7, 1, 5, 1, 9, 3, 2], [True, False, True, True, False, False, True]
    w = torch.randn(DIM, k, generator=gen)
    b = torch.randn(DIM, generator=gen) if bias else None
    # x as the mixer passes it: a strided column slice of a wider projection
    x = torch.randn(sum(lengths), DIM + 3, generator=gen)[:, 2:2 + DIM]
    pool = torch.randn(SLOTS, DIM, k - 1, generator=gen)
    slots = (torch.randperm(SLOTS - 1, generator=gen)[:len(lengths)] + 1).to(torch.int32)
    pool[slots[~torch.tensor(init)].long()] = float("nan")  # never read without an initial state
    before, ref_pool = pool.clone(), pool.clone()
    args = (qsl(lengths), slots, torch.tensor(init), act)
    want = causal_conv1d_ref(x, ref_pool, w, b, *args)
    got = causal_conv1d_cpu(x, pool, w, b, *args)
    assert got.shape == want.shape and rel_err(got, want) < 1e-6
    assert not pool[slots.long()].isnan().any()  # every request's window is rewritten
    assert rel_err(pool[slots.long()], ref_pool[slots.long()]) < 1e-6
    assert untouched(before, pool, slots)


def test_prefill_half_precision_state_and_input():
    gen = torch.Generator().manual_seed(9)
    lengths, init = [3, 6], [True, True]
    w, b = torch.randn(DIM, 4, generator=gen), torch.randn(DIM, generator=gen)
    x = torch.randn(sum(lengths), DIM, generator=gen).half()
    pool = torch.randn(SLOTS, DIM, 3, generator=gen).half()
    ref_pool = pool.clone()
    slots = torch.tensor([5, 2], dtype=torch.int32)
    want = causal_conv1d_ref(x, ref_pool, w, b, qsl(lengths), slots, torch.tensor(init))
    got = causal_conv1d_cpu(x, pool, w, b, qsl(lengths), slots, torch.tensor(init))
    assert got.dtype == torch.float16 and rel_err(got, want) < 2e-3
    assert torch.equal(pool, ref_pool)  # windows are raw inputs: a pure copy


SLOT_LAYOUTS = {  # runs of consecutive slots update in place; too scattered gathers
    "one_run": [3, 4, 5, 6, 7, 8],
    "one_run_shuffled": [6, 3, 8, 4, 7, 5],
    "three_runs": [1, 2, 3, 9, 10, 5],
    "scattered": [11, 1, 5, 9, 3, 7],
}


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", SLOT_LAYOUTS)
def test_decode_matches_reference(layout, pool_dtype):
    gen = torch.Generator().manual_seed(4)
    w, b = torch.randn(DIM, 4, generator=gen), torch.randn(DIM, generator=gen)
    slots = torch.tensor(SLOT_LAYOUTS[layout], dtype=torch.int32)
    x = torch.randn(len(slots), DIM, generator=gen)
    pool = torch.randn(SLOTS, DIM, 3, generator=gen).to(pool_dtype)
    before, ref_pool = pool.clone(), pool.clone()
    want = conv1d_update_ref(x, ref_pool, w, b, slots, "silu")
    got = conv1d_update_cpu(x, pool, w, b, slots, "silu")
    assert rel_err(got, want) < 1e-6
    assert torch.equal(pool, ref_pool)  # the window shift is a pure copy
    assert untouched(before, pool, slots)


def test_bad_shapes_change_nothing():
    gen = torch.Generator().manual_seed(1)
    pool = torch.randn(SLOTS, DIM, 3, generator=gen)
    before = pool.clone()
    with pytest.raises(ValueError, match="conv shapes disagree"):
        causal_conv1d_cpu(torch.randn(4, DIM + 1), pool, torch.randn(DIM, 4), None, qsl([4]),
                          torch.tensor([2], dtype=torch.int32), torch.tensor([True]))
    with pytest.raises(ValueError, match="outside the state pool of 12 slots"):
        causal_conv1d_cpu(torch.randn(4, DIM), pool, torch.randn(DIM, 4), None, qsl([4]),
                          torch.tensor([12], dtype=torch.int32), torch.tensor([True]))
    assert torch.equal(pool, before)
