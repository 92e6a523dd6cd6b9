"""The C decode attention (kernels/attention_decode_native.py) against the reference, on random inputs,
and the torch path it falls back to (native kernels forced off)."""
import math

import pytest
import torch

from hybridkv.kernels import native_cpu
from hybridkv.kernels.attention_cpu import paged_attention_cpu
from hybridkv.kernels.attention_decode_native import native_decodes_usable
from hybridkv.kernels.attention_ref import paged_attention_ref

PATHS = ["native", "torch"]


def run(path, *args, **kw):
    """paged_attention_cpu on the C kernel ("native") or with native kernels off ("torch"); the
    step plan it built."""
    plans = {}
    if path == "native":
        return paged_attention_cpu(*args, plan_cache=plans, **kw), plans
    with native_cpu.forced_off():
        return paged_attention_cpu(*args, plan_cache=plans, **kw), plans


def decode_batch(lens, bs, hkv, group, d, seed, shared_prefix_blocks=0, pad_rows=1, qlens=None):
    """One query per request (or `qlens`) over `lens` keys: q [sum(qlens) + pad_rows, Hq, D]; a pool whose blocks are
    shuffled among spare ones; the first `shared_prefix_blocks` of every request are the same
    pool blocks (a shared prefix); unused table columns hold random ids. Blocks no request reads
    and the unwritten tail of each last block are NaN (no output may see them)."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / bs) for n in lens]
    own = [n - min(shared_prefix_blocks, n) for n in need]
    num_blocks = shared_prefix_blocks + sum(own) + 7
    kv = torch.randn(num_blocks, 2, bs, hkv, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.randint(-1, num_blocks, (len(lens), max(need) + 2), generator=g, dtype=torch.int32)
    prefix, used = perm[:shared_prefix_blocks], shared_prefix_blocks
    for r, n in enumerate(need):
        s = min(shared_prefix_blocks, n)
        table[r, :s] = prefix[:s].to(torch.int32)
        table[r, s:n] = perm[used:used + n - s].to(torch.int32)
        used += n - s
    read = {int(table[r, i]) for r, n in enumerate(need) for i in range(n)}
    for b in range(num_blocks):
        if b not in read:
            kv[b] = float("nan")
    for r, n in enumerate(lens):
        if n % bs and (shared_prefix_blocks == 0 or (n - 1) // bs >= shared_prefix_blocks):
            kv[int(table[r, (n - 1) // bs]), :, n % bs:] = float("nan")
    qlens = qlens or [1] * len(lens)
    q = torch.randn(sum(qlens) + pad_rows, hkv * group, d, generator=g)
    qsl = torch.tensor([0] + qlens).cumsum(0).to(torch.int32)
    return q, kv, qsl, torch.tensor(lens, dtype=torch.int32), table


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


# ragged lengths: 1 key, block edges +-1, several blocks
RAGGED = [1, 15, 16, 17, 33, 64, 100, 5, 47, 250]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("opts", [dict(), dict(sliding_window=20), dict(soft_cap=4.0), dict(sinks=True),
                                  dict(sliding_window=9, soft_cap=2.0, sinks=True)])
def test_decodes_match_reference(path, group, opts):
    q, kv, qsl, seq_lens, table = decode_batch(RAGGED, 16, 2, group, 64, seed=group)
    opts = dict(opts)  # the parametrized dict is shared between cases
    if opts.pop("sinks", False):
        opts["sinks"] = torch.randn(2 * group, generator=torch.Generator().manual_seed(1)) * 2
    want = paged_attention_ref(q, kv, qsl, seq_lens, table, 0.125, **opts)
    got, plans = run(path, q, kv, qsl, seq_lens, table, 0.125, **opts)
    assert torch.isfinite(got).all() and rel_err(got, want) < 1e-5
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))  # the padding row stays zero
    (plan,) = plans.values()
    assert (plan.decodes is not None) == (path == "native")


@pytest.mark.parametrize("d,bs", [(8, 8), (24, 8), (12, 8), (128, 8), (64, 12), (16, 5)])
def test_head_dims_and_block_sizes(d, bs):
    """D a multiple of 16, 8 but not 16, not a multiple of 8 (plain loops), 128; blocks of 12 and 5
    (a block's keys not a multiple of the 8-row logit tree)."""
    q, kv, qsl, seq_lens, table = decode_batch([3, 40, 77], bs, 2, 3, d, seed=d)
    want = paged_attention_ref(q, kv, qsl, seq_lens, table, d ** -0.5)
    got, plans = run("native", q, kv, qsl, seq_lens, table, d ** -0.5)
    assert rel_err(got, want) < 1e-5 and next(iter(plans.values())).decodes is not None


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("lens", [[200], [int(n) for n in torch.randint(1, 300, (64,),
                                                                     generator=torch.Generator().manual_seed(4))]])
def test_batch_1_and_64(path, lens):
    q, kv, qsl, seq_lens, table = decode_batch(lens, 16, 2, 2, 64, seed=len(lens), pad_rows=0)
    want = paged_attention_ref(q, kv, qsl, seq_lens, table, 0.125)
    got, _ = run(path, q, kv, qsl, seq_lens, table, 0.125)
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("path", PATHS)
def test_shared_blocks_and_strided_inputs(path):
    """Requests sharing their first 3 blocks; a block table, a q and a pool that are strided views
    (a column-sliced table, q out of a fused projection, a pool with a wider last dim)."""
    lens = [60, 49, 90, 33, 48]
    q, kv, qsl, seq_lens, table = decode_batch(lens, 16, 2, 2, 32, seed=8, shared_prefix_blocks=3)
    wide_table = torch.full((len(lens), 2 * table.shape[1]), -7, dtype=torch.int32)
    wide_table[:, ::2] = table
    fused = torch.randn(q.shape[0], 3 * q.shape[1], 32)
    fused[:, :q.shape[1]] = q
    wide_pool = torch.randn(*kv.shape[:-1], 40)
    wide_pool[..., :32] = kv
    args = (fused[:, :q.shape[1]], wide_pool[..., :32], qsl, seq_lens, wide_table[:, ::2])
    assert not args[0].is_contiguous() and not args[1].is_contiguous() and not args[4].is_contiguous()
    want = paged_attention_ref(q, kv, qsl, seq_lens, table, 0.2)
    got, plans = run(path, *args, 0.2)
    assert rel_err(got, want) < 1e-5
    assert (next(iter(plans.values())).decodes is not None) == (path == "native")


@pytest.mark.parametrize("window", [None, 12])
def test_mixed_batch_splits_decodes_from_chunks(window):
    """Decodes and a short chunk over context (each of its queries as the decode at its position)
    go to C in one call; a chunk from 0 keeps SDPA."""
    qlens, lens = [1, 9, 1, 6, 1, 0, 1], [40, 9, 3, 30, 17, 5, 64]
    q, kv, qsl, seq_lens, table = decode_batch(lens, 8, 2, 2, 32, seed=12, pad_rows=2, qlens=qlens)
    want = paged_attention_ref(q, kv, qsl, seq_lens, table, 0.2, sliding_window=window)
    got, plans = run("native", q, kv, qsl, seq_lens, table, 0.2, sliding_window=window)
    assert rel_err(got, want) < 1e-5
    assert torch.equal(got[qsl[-1]:], torch.zeros_like(got[qsl[-1]:]))
    (plan,) = plans.values()
    rows = [int(qsl[r]) for r in (0, 2, 4, 6)] + [int(qsl[3]) + j for j in range(6)]
    assert plan.decodes.rows.tolist() == rows and plan.decodes.reqs.tolist() == list(range(len(rows)))
    assert plan.decodes.seq_lens.tolist() == [40, 3, 17, 64] + [25 + j for j in range(6)]
    assert [grp.lmax for grp in plan.groups] == [9]


def test_half_precision_takes_the_torch_path():
    q, kv, qsl, seq_lens, table = decode_batch([20, 40], 16, 2, 2, 32, seed=5)
    q16, kv16 = q.half(), kv.nan_to_num().half()
    assert native_decodes_usable(q, kv) and not native_decodes_usable(q16, kv16)
    got, plans = run("native", q16, kv16, qsl, seq_lens, table, 0.2)
    assert got.dtype == torch.float16 and next(iter(plans.values())).decodes is None
    assert rel_err(got, paged_attention_ref(q16, kv16, qsl, seq_lens, table, 0.2)) < 2e-3


def test_a_block_outside_the_pool_raises():
    q, kv, qsl, seq_lens, table = decode_batch([20, 40], 16, 2, 2, 32, seed=6)
    table[1, 2] = kv.shape[0]  # read by request 1 (40 keys: blocks 0..2)
    with pytest.raises(ValueError, match=r"request 1: .* outside the pool of"):
        run("native", q, kv, qsl, seq_lens, table, 0.2)
