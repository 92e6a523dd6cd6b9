"""The batched CPU Mamba2 chunked scan (kernels/mamba2_cpu.py) against the reference, random inputs;
the prefill tests run on the C kernels and on the torch path (tests/prefill_paths.py)."""
import pytest
import torch

import hybridkv.kernels as K
from hybridkv.kernels.mamba2_cpu import mamba2_chunk_scan_cpu
from hybridkv.kernels.mamba2_ref import mamba2_chunk_scan_ref
from prefill_paths import prefill_path  # noqa: F401 (fixture)

H, P, G, N, SLOTS = 4, 6, 2, 5, 9


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def case(lengths, init, seed=0, with_z=True, groups=G):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    args = dict(
        x=torch.randn(T, H, P, generator=g), dt=torch.randn(T, H, generator=g),
        A=-torch.exp(torch.randn(H, generator=g) * 0.5), B=torch.randn(T, groups, N, generator=g),
        C=torch.randn(T, groups, N, generator=g), D=torch.randn(H, generator=g),
        z=torch.randn(T, H, P, generator=g) if with_z else None, dt_bias=torch.randn(H, generator=g) * 0.5)
    qsl = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    slots = (torch.randperm(SLOTS - 1, generator=g)[:len(lengths)] + 1).to(torch.int32)
    pool = torch.randn(SLOTS, H, P, N, generator=g)
    pool[slots[~torch.tensor(init)].long()] = float("nan")  # ignored when has_initial_state is False
    return args, qsl, slots, torch.tensor(init), pool


@pytest.mark.parametrize("chunk_size", [4, 16])
@pytest.mark.parametrize("dt_limit", [None, (0.05, 1.5)])
def test_matches_reference(chunk_size, dt_limit, prefill_path):
    lengths = [37, 1, 16, 0, 5, 33, 0]
    init = [False, True, True, True, False, True, False]
    args, qsl, slots, has_init, pool = case(lengths, init, seed=chunk_size)
    ref_pool, cpu_pool = pool.clone(), pool.clone()
    want = mamba2_chunk_scan_ref(ref_pool, **args, query_start_loc=qsl, slot_idx=slots,
                                 has_initial_state=has_init, chunk_size=chunk_size, dt_limit=dt_limit)
    got = mamba2_chunk_scan_cpu(cpu_pool, **args, query_start_loc=qsl, slot_idx=slots,
                                has_initial_state=has_init, chunk_size=chunk_size, dt_limit=dt_limit)
    assert got.dtype == want.dtype and rel_err(got, want) < 1e-5
    touched = slots.long()
    assert rel_err(cpu_pool[touched].nan_to_num(), ref_pool[touched].nan_to_num()) < 1e-5
    assert torch.equal(ref_pool[touched].isnan(), cpu_pool[touched].isnan())  # same slots written
    others = [s for s in range(SLOTS) if s not in touched.tolist()]
    assert torch.equal(cpu_pool[others], pool[others])  # other slots untouched


def test_single_request_without_gate_and_dispatch(monkeypatch, prefill_path):
    """kernels.mamba2_chunk_scan runs this path (the reference stays the spec)."""
    import hybridkv.kernels.mamba2_cpu as mod

    calls = []
    monkeypatch.setattr(mod, "mamba2_chunk_scan_cpu",
                        lambda *a, **k: calls.append(1) or mamba2_chunk_scan_cpu(*a, **k))
    args, qsl, slots, has_init, pool = case([50], [True], seed=5, with_z=False)
    ref_pool, cpu_pool = pool.clone(), pool.clone()
    want = mamba2_chunk_scan_ref(ref_pool, **args, query_start_loc=qsl, slot_idx=slots,
                                 has_initial_state=has_init, chunk_size=8)
    got = K.mamba2_chunk_scan(cpu_pool, args["x"], args["dt"], args["A"], args["B"], args["C"],
                              args["D"], None, args["dt_bias"], qsl, slots, has_init, chunk_size=8)
    assert calls == [1] and rel_err(got, want) < 1e-5 and rel_err(cpu_pool, ref_pool) < 1e-5


@pytest.mark.parametrize("groups", [1, 2])
def test_states_at_positions_match_reference(groups, prefill_path):
    """Ragged lengths around the chunk (1, chunk - 1, chunk, chunk + 1, several chunks), states
    asked at chunk ends, mid-chunk, the first and the last token, and not at all."""
    lengths = [1, 7, 8, 9, 20, 17]
    init = [False, True, True, False, True, True]
    args, qsl, slots, has_init, pool = case(lengths, init, seed=2 + groups, groups=groups)
    at = [[1], [3, 7], [], [8, 9], [1, 8, 13, 16, 20], [17, 5]]
    a, b = pool.clone(), pool.clone()
    kw = dict(query_start_loc=qsl, slot_idx=slots, has_initial_state=has_init, chunk_size=8,
              return_states_at=at)
    y1, s1 = mamba2_chunk_scan_ref(a, **args, **kw)
    y2, s2 = mamba2_chunk_scan_cpu(b, **args, **kw)
    assert rel_err(y2, y1) < 1e-5
    assert [tuple(t.shape) for t in s1] == [tuple(t.shape) for t in s2]
    assert all(rel_err(v, u) < 1e-5 for u, v in zip(s1, s2) if u.numel())
    touched = slots.long()
    assert rel_err(b[touched], a[touched]) < 1e-5


def test_mixer_layout_and_decays_past_the_cut(prefill_path):
    """x, B, C as the mixer passes them (strided column slices of one projection), decays that
    fall below exp(-60) inside a chunk (taken as exact zeros), and a request that ends on a chunk
    boundary next to ones that do not."""
    g = torch.Generator().manual_seed(7)
    lengths, init = [16, 3, 0, 21], [True, False, True, True]
    T, groups = sum(lengths), 1
    proj = torch.randn(T, H * P + 2 * groups * N + 3, generator=g)
    x = proj[:, :H * P].view(T, H, P)
    B = proj[:, H * P:H * P + groups * N].view(T, groups, N)
    C = proj[:, H * P + groups * N:H * P + 2 * groups * N].view(T, groups, N)
    args = dict(x=x, dt=torch.randn(T, H, generator=g), A=-torch.exp(torch.randn(H, generator=g)) * 20,
                B=B, C=C, D=torch.randn(H, generator=g), z=None, dt_bias=torch.randn(H, generator=g))
    pool = torch.randn(SLOTS, H, P, N, generator=g)
    kw = dict(query_start_loc=torch.tensor([0] + lengths).cumsum(0).to(torch.int32),
              slot_idx=torch.tensor([3, 1, 8, 5], dtype=torch.int32), has_initial_state=torch.tensor(init),
              chunk_size=8, return_states_at=[[8, 16], [2], [], [1, 21]])
    a, b = pool.clone(), pool.clone()
    y1, s1 = mamba2_chunk_scan_ref(a, **args, **kw)
    y2, s2 = mamba2_chunk_scan_cpu(b, **args, **kw)
    assert rel_err(y2, y1) < 1e-5 and rel_err(b, a) < 1e-5
    assert all(rel_err(v, u) < 1e-5 for u, v in zip(s1, s2) if u.numel())


@pytest.mark.parametrize("short", [False, True])
def test_long_chunks_are_cut_at_the_cpu_chunk(short, prefill_path):
    """A checkpoint's chunk_size of 256 (Bamba's): the CPU scan cuts chunks of CPU_CHUNK tokens, or
    fewer for a call of short pieces, and still matches the reference run with chunks of 256,
    states at positions included."""
    from hybridkv.kernels.mamba2_cpu import CPU_CHUNK

    n = 5 if short else 2 * CPU_CHUNK  # short: chunks of 16 (the power of two above 15)
    lengths, init = [n + 10, 3, n], [True, False, False]
    args, qsl, slots, has_init, pool = case(lengths, init, seed=9)
    kw = dict(query_start_loc=qsl, slot_idx=slots, has_initial_state=has_init, chunk_size=256,
              return_states_at=[[n // 2, n, n + 10], [3], [n // 2 + 1]])
    a, b = pool.clone(), pool.clone()
    y1, s1 = mamba2_chunk_scan_ref(a, **args, **kw)
    y2, s2 = mamba2_chunk_scan_cpu(b, **args, **kw)
    assert rel_err(y2, y1) < 1e-5
    assert all(rel_err(v, u) < 1e-5 for u, v in zip(s1, s2))
    assert rel_err(b[slots.long()].nan_to_num(), a[slots.long()].nan_to_num()) < 1e-5


def test_native_decay_scores_elementwise():
    """The C kernels' exp against torch's, element by element (a relative error the end-to-end
    tolerances would not see): decay x C.B below the diagonal, exact zeros above it and past the cut."""
    from hybridkv.kernels import mamba2_prefill_native
    from hybridkv.kernels.mamba2_cpu import _CUT

    if not mamba2_prefill_native.usable(torch.zeros(1)):
        pytest.fail("these machines have a C compiler; the prefill C kernels must build here")
    g = torch.Generator().manual_seed(8)
    nc, cs, heads, groups = 3, 16, 4, 2
    acum = (-torch.rand(nc, cs, heads, generator=g) * 9).cumsum(1)  # reaches below the cut
    cb = torch.randn(nc, groups, cs, cs, generator=g)
    got = mamba2_prefill_native.ssd_scores(acum, cb, heads, _CUT)
    a = acum.transpose(1, 2)
    seg = (a[..., :, None] - a[..., None, :]).double()  # the difference in fp32, as the kernels take it
    keep = (seg >= _CUT) & torch.ones(cs, cs, dtype=torch.bool).tril()
    want = torch.where(keep, seg.exp(), 0) * cb.double().repeat_interleave(heads // groups, 1)
    assert torch.equal(got == 0, want == 0) and (seg < _CUT).any()
    assert ((got.double() - want).abs() / want.abs().clamp_min(1e-30)).max() < 1e-6


def test_half_precision_takes_the_torch_path():
    """fp16 inputs and pool: the C kernels take fp32 only; the result still matches the reference."""
    args, qsl, slots, has_init, pool = case([9, 4], [True, False], seed=6)
    args = {k: v.half() if k in ("x", "B", "C", "z") else v for k, v in args.items()}
    pool = pool.half()
    a, b = pool.clone(), pool.clone()
    kw = dict(query_start_loc=qsl, slot_idx=slots, has_initial_state=has_init, chunk_size=4)
    want = mamba2_chunk_scan_ref(a, **args, **kw)
    got = mamba2_chunk_scan_cpu(b, **args, **kw)
    assert got.dtype == torch.float16 and rel_err(got, want) < 2e-3
    touched = slots.long()
    assert rel_err(b[touched].nan_to_num(), a[touched].nan_to_num()) < 2e-3


def test_bad_position_changes_nothing():
    args, qsl, slots, has_init, pool = case([5, 3], [True, True], seed=4)
    before = pool.clone()
    with pytest.raises(ValueError, match="position 4 of request 1 is outside 1..3"):
        mamba2_chunk_scan_cpu(pool, **args, query_start_loc=qsl, slot_idx=slots,
                              has_initial_state=has_init, chunk_size=4, return_states_at=[[5], [4]])
    assert torch.equal(pool, before)


SLOT_LAYOUTS = {  # scattered: gather + write back; a range (sorted or not): a view of the pool
    "scattered": lambda g, nb: torch.randperm(SLOTS - 1, generator=g)[:nb] + 1,
    "range": lambda g, nb: torch.arange(2, 2 + nb),
    "range_shuffled": lambda g, nb: torch.randperm(nb, generator=g) + 3,
    "range_with_hole": lambda g, nb: torch.tensor([7, 2, 3, 5, 6]),
}


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_z, dt_limit", [(True, None), (False, (0.05, 1.5))])
@pytest.mark.parametrize("layout", SLOT_LAYOUTS)
def test_state_update_matches_reference(pool_dtype, with_z, dt_limit, layout):
    from hybridkv.kernels.mamba2_cpu import mamba2_state_update_cpu
    from hybridkv.kernels.mamba2_ref import mamba2_state_update_ref

    g = torch.Generator().manual_seed(3)
    nb = 5
    x, dt = torch.randn(nb, H, P, generator=g), torch.randn(nb, H, generator=g)
    A = -torch.exp(torch.randn(H, generator=g) * 0.5)
    # B and C as the mixer passes them: strided column slices of one projection
    B, C = torch.randn(nb, 3 * G * N, generator=g)[:, G * N:].view(nb, 2, G, N).unbind(1)
    D, dt_bias = torch.randn(H, generator=g), torch.randn(H, generator=g) * 0.5
    z = torch.randn(nb, H, P, generator=g) if with_z else None
    slots = SLOT_LAYOUTS[layout](g, nb).to(torch.int32)
    pool = torch.randn(SLOTS, H, P, N, generator=g).to(pool_dtype)
    ref_pool, cpu_pool = pool.clone(), pool.clone()
    want = mamba2_state_update_ref(ref_pool, x, dt, A, B, C, D, z, dt_bias, slots, True, dt_limit)
    got = mamba2_state_update_cpu(cpu_pool, x, dt, A, B, C, D, z, dt_bias, slots, True, dt_limit)
    tol = 1e-5 if pool_dtype == torch.float32 else 2e-3
    assert rel_err(got, want) < tol
    assert rel_err(cpu_pool, ref_pool) < tol
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[slots.long()] = False
    assert torch.equal(cpu_pool[untouched], pool[untouched])
