"""The in-place CPU Mamba1 decode step (kernels/mamba1_cpu.py) against the reference, random inputs."""
import pytest
import torch

import hybridkv.kernels as K
from hybridkv.kernels.mamba1_cpu import mamba1_state_update_cpu
from hybridkv.kernels.mamba1_ref import mamba1_state_update_ref
from state_kernel_helpers import rel_err

D_INNER, N, SLOTS, NB = 12, 5, 10, 5
SLOT_LAYOUTS = {  # scattered: gather + write back; a range (sorted or not): a view of the pool
    "scattered": lambda g: torch.randperm(SLOTS - 1, generator=g)[:NB] + 1,
    "range": lambda g: torch.arange(2, 2 + NB),
    "range_shuffled": lambda g: torch.randperm(NB, generator=g) + 3,
    "range_with_hole": lambda g: torch.tensor([7, 2, 3, 5, 6]),
}


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_z", [True, False])
@pytest.mark.parametrize("layout", SLOT_LAYOUTS)
def test_state_update_matches_reference(pool_dtype, with_z, layout):
    g = torch.Generator().manual_seed(4)
    x, dt = torch.randn(NB, D_INNER, generator=g), torch.randn(NB, D_INNER, generator=g)
    A = -torch.exp(torch.randn(D_INNER, N, generator=g) * 0.5)
    # B and C as the mixer passes them: strided column slices of one projection
    B, C = torch.randn(NB, 3 * N, generator=g)[:, N:].view(NB, 2, N).unbind(1)
    D, dt_bias = torch.randn(D_INNER, generator=g), torch.randn(D_INNER, generator=g) * 0.5
    z = torch.randn(NB, D_INNER, generator=g) if with_z else None
    slots = SLOT_LAYOUTS[layout](g).to(torch.int32)
    pool = torch.randn(SLOTS, D_INNER, N, generator=g).to(pool_dtype)
    ref_pool, cpu_pool = pool.clone(), pool.clone()
    want = mamba1_state_update_ref(ref_pool, x, dt, A, B, C, D, z, dt_bias, slots)
    got = mamba1_state_update_cpu(cpu_pool, x, dt, A, B, C, D, z, dt_bias, slots)
    tol = 1e-5 if pool_dtype == torch.float32 else 2e-3
    assert rel_err(got, want) < tol and rel_err(cpu_pool, ref_pool) < tol
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[slots.long()] = False
    assert torch.equal(cpu_pool[untouched], pool[untouched])


def test_dispatch_routes_cpu_here(monkeypatch):
    monkeypatch.delenv("HYBRIDKV_BACKEND", raising=False)
    import hybridkv.kernels.mamba1_cpu as mod

    calls = []
    monkeypatch.setattr(mod, "mamba1_state_update_cpu",
                        lambda *a: calls.append(1) or mamba1_state_update_cpu(*a))
    g = torch.Generator().manual_seed(1)
    pool = torch.randn(SLOTS, D_INNER, N, generator=g)
    args = (torch.randn(2, D_INNER, generator=g), torch.randn(2, D_INNER, generator=g),
            -torch.rand(D_INNER, N, generator=g), torch.randn(2, N, generator=g),
            torch.randn(2, N, generator=g), None, None, None, torch.tensor([1, 2], dtype=torch.int32))
    want = mamba1_state_update_ref(pool.clone(), *args)
    assert rel_err(K.mamba1_state_update(pool, *args), want) < 1e-5 and calls == [1]
