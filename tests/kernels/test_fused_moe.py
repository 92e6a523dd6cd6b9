"""Fused MoE: the torch grouped-matmul path and the Triton kernel (TRITON_INTERPRET=1 on CPU)
against the reference, the expert sort without host reads, and bad input."""
import pytest
import torch

from hybridkv.kernels.fused_moe_cpu import _grouped_linear, fused_moe_torch
from hybridkv.kernels.fused_moe_ref import fused_moe_ref
from hybridkv.kernels.moe_sort import expert_counts, sort_by_expert
from hybridkv.scheduler.host_sync_check import HostSyncError, NoHostSync

TOL = {torch.float32: 1e-5, torch.float16: 3e-3}


def _inputs(gen, T, E, k, H=24, I=40, dtype=torch.float32, gated=True):
    x = torch.randn(T, H, generator=gen)
    w_gate_up = torch.randn(E, (2 if gated else 1) * I, H, generator=gen) * 0.3
    w_down = torch.randn(E, H, I, generator=gen) * 0.3
    weights, ids = torch.topk(torch.randn(T, E, generator=gen).softmax(-1), k)
    return x.to(dtype), w_gate_up.to(dtype), w_down.to(dtype), weights.to(dtype), ids


def _rel(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


CASES = [(1, 4, 1), (1, 8, 2), (5, 8, 8), (17, 16, 4), (33, 6, 2), (70, 12, 6)]  # tokens, E, k


@pytest.mark.parametrize("T,E,k", CASES)
def test_torch_path_matches_reference(T, E, k):
    inp = _inputs(torch.Generator().manual_seed(T * 100 + E), T, E, k)
    got, want = fused_moe_torch(*inp), fused_moe_ref(*inp)
    assert _rel(got, want) < 1e-6


def test_torch_path_loop_fallback_matches(monkeypatch):
    """torch < 2.8 has no _grouped_mm: the per-expert loop after one read of the counts."""
    inp = _inputs(torch.Generator().manual_seed(7), 23, 8, 3)
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    assert _rel(fused_moe_torch(*inp), fused_moe_ref(*inp)) < 1e-6


@pytest.mark.slow  # interpreted Triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,E,k", CASES)
def test_triton_kernel_matches_reference(T, E, k, dtype):
    from hybridkv.kernels.fused_moe_kernel import fused_moe_triton

    inp = _inputs(torch.Generator().manual_seed(T * 10 + k), T, E, k, dtype=dtype)
    got = fused_moe_triton(*inp)
    assert got.dtype == dtype and got.shape == inp[0].shape
    assert _rel(got, fused_moe_ref(*inp)) < TOL[dtype]


def test_no_tokens_gives_an_empty_output():
    from hybridkv.kernels.fused_moe_kernel import fused_moe_triton

    x, w1, w2, w, ids = _inputs(torch.Generator().manual_seed(2), 0, 4, 2)
    for fn in (fused_moe_ref, fused_moe_torch, fused_moe_triton):
        assert fn(x, w1, w2, w, ids).shape == (0, 24)


@pytest.mark.slow  # interpreted Triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (29, 8, 2)])
def test_ungated_relu2_experts_match_reference(T, E, k, dtype):
    """Nemotron-H's experts: down(relu(up x)^2), no gate rows."""
    from hybridkv.kernels.fused_moe_kernel import fused_moe_triton

    inp = _inputs(torch.Generator().manual_seed(T + 5), T, E, k, dtype=dtype, gated=False)
    want = fused_moe_ref(*inp, activation="relu2", gated=False)
    x, w_up = inp[0].float(), inp[1].float()
    ids = inp[4]
    by_hand = sum(inp[3][:, j, None].float() * torch.einsum(
        "ti,thi->th", torch.relu(torch.einsum("th,tih->ti", x, w_up[ids[:, j]])) ** 2,
        inp[2].float()[ids[:, j]]) for j in range(k))
    assert _rel(want, by_hand) < TOL[dtype]
    assert _rel(fused_moe_torch(*inp, activation="relu2", gated=False), want) < TOL[dtype]
    assert _rel(fused_moe_triton(*inp, activation="relu2", gated=False), want) < TOL[dtype]


@pytest.mark.slow  # interpreted Triton
def test_triton_kernel_odd_sizes_and_strided_hidden():
    """Sizes that are no multiple of any tile (H=20, I=36) and a hidden view with a row stride."""
    from hybridkv.kernels.fused_moe_kernel import fused_moe_triton

    x, w1, w2, w, ids = _inputs(torch.Generator().manual_seed(3), 9, 5, 2, H=20, I=36)
    wide = torch.randn(9, 50)
    wide[:, 3:23] = x
    got = fused_moe_triton(wide[:, 3:23], w1, w2, w, ids)
    assert _rel(got, fused_moe_ref(x, w1, w2, w, ids)) < 1e-5


@pytest.mark.slow  # interpreted Triton
def test_public_api_runs_both_backends(monkeypatch):
    import hybridkv.kernels as hk

    inp = _inputs(torch.Generator().manual_seed(11), 12, 8, 2)
    ungated = _inputs(torch.Generator().manual_seed(12), 12, 8, 2, gated=False)
    want = fused_moe_ref(*inp)
    want_ungated = fused_moe_ref(*ungated, activation="relu2", gated=False)
    for backend in ("torch", "triton"):
        monkeypatch.setenv("HYBRIDKV_BACKEND", backend)
        assert _rel(hk.fused_moe(*inp), want) < 1e-5, backend
        got = hk.fused_moe(*ungated, activation="relu2", gated=False)
        assert _rel(got, want_ungated) < 1e-5, backend


def _assert_expert_layout(ids, E, block, b):
    """Every pair once, runs by expert padded to the block, each block one expert's."""
    n = ids.numel()
    pairs = b.sorted_pairs.long()
    assert pairs.numel() % block == 0 and b.block_expert.numel() == pairs.numel() // block
    padded = int(b.num_padded)
    real = pairs[pairs < n]
    assert torch.equal(real.sort().values, torch.arange(n)), "each pair exactly once"
    assert (pairs[padded:] == n).all()
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    assert padded == int(((counts + block - 1) // block * block).sum())
    flat = ids.reshape(-1)
    for blk in range(padded // block):
        rows = pairs[blk * block:(blk + 1) * block]
        rows = rows[rows < n]
        assert (flat[rows] == int(b.block_expert[blk])).all()


@pytest.mark.parametrize("T,E,k,block", [(1, 4, 2, 16), (70, 64, 8, 16), (33, 6, 3, 64)])
def test_sort_by_expert_layout(T, E, k, block):
    ids = torch.topk(torch.randn(T, E, generator=torch.Generator().manual_seed(T)), k).indices
    _assert_expert_layout(ids, E, block, sort_by_expert(ids, E, block))


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="the loop fallback reads the counts once")
def test_sort_and_grouped_matmul_read_nothing_back():
    """No host sync (NoHostSync: no .item() / .tolist() / bool() of a tensor, no op whose output
    shape depends on values, no host-device copy) in the expert count, the sort and the grouped
    matmul; their results equal references computed outside the check."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.topk(torch.randn(9, 8, generator=gen), 2).indices
    flat = ids.reshape(-1)
    x = torch.randn(18, 16, generator=gen)[flat.argsort(stable=True)]  # rows already by expert
    w = torch.randn(8, 12, 16, generator=gen)
    with NoHostSync():
        counts = expert_counts(ids, 8)
        blocks = sort_by_expert(ids, 8, 16)
        out = _grouped_linear(x, w, counts.cumsum(0).to(torch.int32))
    assert torch.equal(counts, torch.bincount(flat, minlength=8))
    _assert_expert_layout(ids, 8, 16, blocks)
    want = torch.einsum("mk,mnk->mn", x, w[flat.sort(stable=True).values])  # row m @ its expert's w
    assert torch.allclose(out, want, atol=1e-5, rtol=1e-5)


def test_no_host_sync_catches_the_loop_fallback(monkeypatch):
    """The check above can fail: the per-expert loop's read of the counts raises."""
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    ends = torch.tensor([1, 4], dtype=torch.int32)
    with pytest.raises(HostSyncError, match="tolist"), NoHostSync():
        _grouped_linear(torch.randn(4, 16), torch.randn(2, 12, 16), ends)


@pytest.mark.parametrize("bad,match", [
    (dict(w_down=torch.randn(4, 24, 41)), r"w_down has shape \(4, 24, 41\); expected"),
    (dict(topk_ids=torch.tensor([[0, 4]] * 3)), r"expert ids must be in \[0, 4\)"),
    (dict(topk_weights=torch.rand(3, 3)), r"topk_weights has shape \(3, 3\)"),
    (dict(hidden=torch.randn(3, 25)), r"hidden_size=25"),
])
def test_bad_input_is_rejected(bad, match):
    x, w1, w2, w, ids = _inputs(torch.Generator().manual_seed(0), 3, 4, 2)
    args = dict(hidden=x, w_gate_up=w1, w_down=w2, topk_weights=w, topk_ids=ids)
    args.update(bad)
    for fn in (fused_moe_ref, fused_moe_torch):
        with pytest.raises(ValueError, match=match):
            fn(**args)
