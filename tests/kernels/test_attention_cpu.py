"""The fast CPU paged attention (kernels/attention_cpu.py) against the reference, on random inputs."""
import math

import pytest
import torch

import hybridkv.kernels as K
from hybridkv.kernels import native_cpu
from hybridkv.kernels.attention_cpu import decode_buckets, paged_attention_cpu
from hybridkv.kernels.attention_ref import paged_attention_ref

# (query_len, seq_len): decodes at block edges, prefill chunks from 0 and after a context, an idle
# request (0 queries), a one-token prompt
MIXED = [(1, 1), (1, 17), (5, 33), (16, 16), (0, 10), (15, 31), (1, 64), (3, 32), (40, 70)]


def paged_batch(reqs, bs, hkv, group, d, dtype=torch.float32, seed=0, pad_rows=2):
    """Random q [T, Hq, D], a pool with shuffled blocks (spare ones between), a block table whose
    unused columns hold random block ids, query_start_loc and seq_lens."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(s / bs) for _, s in reqs]
    num_blocks = sum(need) + 6
    kv = torch.randn(num_blocks, 2, bs, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.randint(0, num_blocks, (len(reqs), max(need) + 2), generator=g, dtype=torch.int32)
    used = 0
    for r, n in enumerate(need):
        table[r, :n] = perm[used:used + n].to(torch.int32)
        used += n
    t = sum(ql for ql, _ in reqs) + pad_rows
    q = torch.randn(t, hkv * group, d, generator=g).to(dtype)
    qsl = torch.tensor([0] + [ql for ql, _ in reqs]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for _, s in reqs], dtype=torch.int32)
    return q, kv, qsl, seq_lens, table

def poison_unread(kv, table, reqs, bs):
    """NaN into every pool block no request of `reqs` [(qlen, seq_len)] reads and into the
    unwritten tail of each request's last block: an output that touches them is not finite."""
    used = {int(table[r, i]) for r, (_, s) in enumerate(reqs) for i in range(-(-s // bs))}
    for b in range(kv.shape[0]):
        if b not in used:
            kv[b] = float("nan")
    for r, (_, s) in enumerate(reqs):
        kv[int(table[r, (s - 1) // bs]), :, s % bs or bs:] = float("nan")



def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.fixture(params=["native", "torch"])
def decode_path(request):
    """Decodes through the C kernel (kernels/attention_decode_native.py) or the torch buckets."""
    if request.param == "native":
        yield request.param
    else:
        with native_cpu.forced_off():
            yield request.param


@pytest.mark.parametrize("bs,hkv,group,d", [(16, 2, 2, 32), (8, 1, 4, 16), (32, 4, 1, 64)])
@pytest.mark.parametrize("opts", [dict(), dict(sliding_window=7), dict(soft_cap=5.0),
                                  dict(causal=False), dict(sliding_window=20, soft_cap=2.0)])
def test_matches_reference(bs, hkv, group, d, opts, decode_path):
    q, kv, qsl, seq_lens, table = paged_batch(MIXED, bs, hkv, group, d, seed=bs + d)
    scale = d ** -0.5
    want = paged_attention_ref(q, kv, qsl, seq_lens, table, scale, **opts)
    got = paged_attention_cpu(q, kv, qsl, seq_lens, table, scale, **opts)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert rel_err(got, want) < 1e-5
    assert torch.equal(got[qsl[-1]:], torch.zeros_like(got[qsl[-1]:]))  # padding rows stay zero


@pytest.mark.parametrize("reqs", [[(1, s) for s in (1, 5, 16, 17, 90)], [(33, 33)], [(7, 50), (2, 2)]])
def test_all_decode_or_all_prefill(reqs, decode_path):
    q, kv, qsl, seq_lens, table = paged_batch(reqs, 16, 2, 3, 32, seed=len(reqs))
    want = paged_attention_ref(q, kv, qsl, seq_lens, table, 0.2)
    assert rel_err(paged_attention_cpu(q, kv, qsl, seq_lens, table, 0.2), want) < 1e-5


def test_decode_buckets_bound_the_padding():
    assert decode_buckets([4] * 31 + [128]) == [list(range(31)), [31]]  # the long one runs alone
    assert decode_buckets([3, 1, 2, 2]) == [[1, 2, 3, 0]]  # sorted; padding 4 blocks <= slack 16
    assert decode_buckets([10, 20, 30, 40]) == [[0, 1], [2, 3]]  # 10 + 20: padding 10 <= 16; + 30: 30 > 16
    assert decode_buckets([]) == []
    sizes = [1, 7, 2, 30, 30, 5, 64, 1, 9, 16]
    buckets = decode_buckets(sizes)
    assert sorted(i for b in buckets for i in b) == list(range(len(sizes)))
    for b in buckets:
        held = sum(sizes[i] for i in b)
        assert len(b) * max(sizes[i] for i in b) - held <= max(0.25 * held, 16)


@pytest.mark.parametrize("opts", [dict(), dict(sliding_window=40), dict(soft_cap=3.0)])
def test_skewed_decodes_match_reference(opts, decode_path):
    """31 short decodes and one long one (separate buckets), with a prefill chunk in the batch."""
    reqs = [(1, 20 + 3 * i) for i in range(31)] + [(1, 700), (9, 50)]
    q, kv, qsl, seq_lens, table = paged_batch(reqs, 16, 2, 2, 32, seed=11)
    want = paged_attention_ref(q, kv, qsl, seq_lens, table, 0.2, **opts)
    assert rel_err(paged_attention_cpu(q, kv, qsl, seq_lens, table, 0.2, **opts), want) < 1e-5


def test_half_precision_pool_matches_reference():
    q, kv, qsl, seq_lens, table = paged_batch(MIXED, 16, 2, 2, 32, dtype=torch.float16, seed=3)
    want = paged_attention_ref(q, kv, qsl, seq_lens, table, 0.15)
    got = paged_attention_cpu(q, kv, qsl, seq_lens, table, 0.15)
    assert got.dtype == torch.float16 and rel_err(got, want) < 2e-3


def test_bad_inputs_raise_like_the_reference():
    q, kv, qsl, seq_lens, table = paged_batch([(3, 2)], 16, 2, 2, 16)
    with pytest.raises(ValueError, match="query_len 3 > seq_len 2"):
        paged_attention_cpu(q, kv, qsl, seq_lens, table, 0.1)
    q, kv, qsl, seq_lens, table = paged_batch([(1, 20)], 16, 2, 2, 16)
    with pytest.raises(ValueError, match="block_table has 1 columns"):
        paged_attention_cpu(q, kv, qsl, seq_lens, table[:, :1], 0.1)


def test_dispatch_routes_cpu_torch_backend_here(monkeypatch):
    """kernels.paged_attention on CPU tensors runs this path (the reference stays the spec)."""
    monkeypatch.delenv("HYBRIDKV_BACKEND", raising=False)
    calls = []
    import hybridkv.kernels.attention_cpu as mod

    monkeypatch.setattr(mod, "paged_attention_cpu", lambda *a, **k: calls.append(1) or paged_attention_cpu(*a, **k))
    q, kv, qsl, seq_lens, table = paged_batch(MIXED, 16, 2, 2, 32)
    out = K.paged_attention(q, kv, qsl, seq_lens, table, 0.2)
    assert calls == [1] and rel_err(out, paged_attention_ref(q, kv, qsl, seq_lens, table, 0.2)) < 1e-5


@pytest.mark.parametrize("opts", [dict(), dict(sliding_window=9), dict(soft_cap=4.0)])
def test_one_step_plan_serves_every_layer(opts, decode_path):
    """Layers of one step share a plan_cache: the second layer (other q, other pool, same block
    table) reuses the first one's plan and still matches the reference."""
    plans = {}
    for layer in range(2):
        q, kv, qsl, seq_lens, table = paged_batch(MIXED, 16, 2, 2, 32, seed=5)
        g = torch.Generator().manual_seed(100 + layer)
        q, kv = torch.randn(q.shape, generator=g), torch.randn(kv.shape, generator=g)
        want = paged_attention_ref(q, kv, qsl, seq_lens, table, 0.2, **opts)
        got = paged_attention_cpu(q, kv, qsl, seq_lens, table, 0.2, plan_cache=plans, **opts)
        assert rel_err(got, want) < 1e-5
    assert len(plans) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_cpu_matches_reference(dtype):
    from hybridkv.kernels.attention_ref import write_kv_ref
    from hybridkv.kernels.write_kv_cpu import write_kv_cpu

    g = torch.Generator().manual_seed(7)
    pool = torch.randn(9, 2, 8, 2, 16, generator=g).to(dtype)
    slots = torch.randperm(9 * 8, generator=g)[:20]
    slots[[3, 11]] = -1  # padding rows are skipped
    plans = {}
    for layer in range(2):  # the second write reuses the step's indices
        k, v = torch.randn(2, 20, 2, 16, generator=g)
        want = write_kv_ref(k, v, pool.clone(), slots)
        got = write_kv_cpu(k, v, pool.clone(), slots, plan_cache=plans)
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="k has shape"):
        write_kv_cpu(k[:3], v, pool, slots)


def test_blocks_no_request_owns_may_hold_nan(decode_path):
    """Pool blocks outside every request's real keys (freed, another owner's) are NaN: no output
    row may see them, on the decode and on the prefill path."""
    reqs = [(1, 21), (7, 7), (12, 29), (1, 70)]
    q, kv, qsl, seq_lens, table = paged_batch(reqs, 16, 2, 2, 32, seed=9)
    poison_unread(kv, table, reqs, 16)
    want = paged_attention_ref(q, kv, qsl, seq_lens, table, 0.2)
    got = paged_attention_cpu(q, kv, qsl, seq_lens, table, 0.2, plan_cache={})
    assert torch.isfinite(got).all() and rel_err(got, want) < 1e-5


@pytest.mark.parametrize("reqs", [[(1, 37)], [(1, 40)] * 3, [(9, 9)], [(1, 16)] * 2])
@pytest.mark.parametrize("opts", [dict(), dict(sliding_window=7), dict(soft_cap=3.0)])
def test_one_group_in_order_returns_its_rows(reqs, opts):
    """Batch-1 decodes, equal-length decodes and a lone prefill with no padding rows: the fast
    path attends to exactly the requests' keys and returns the group's rows as the output; the
    unwritten tail of each last block and every block no request owns hold NaN. (The torch path:
    with native kernels on, these decodes run in C.)"""
    q, kv, qsl, seq_lens, table = paged_batch(reqs, 16, 2, 2, 32, seed=len(reqs), pad_rows=0)
    poison_unread(kv, table, reqs, 16)
    q_before = q.clone()
    want = paged_attention_ref(q, kv, qsl, seq_lens, table, 0.2, **opts)
    plans = {}
    with native_cpu.forced_off():
        got = paged_attention_cpu(q, kv, qsl, seq_lens, table, 0.2, plan_cache=plans, **opts)
    assert torch.isfinite(got).all() and rel_err(got, want) < 1e-5
    assert torch.equal(q, q_before)  # q may be read in place, never written
    (plan,) = plans.values()
    (grp,) = plan.groups
    assert plan.decodes is None and grp.first_row == 0 and grp.tail is None and grp.n_keys


def test_write_kv_cpu_non_contiguous_pool():
    """A pool that is a strided view (not one buffer of rows) takes the indexed-write path."""
    from hybridkv.kernels.attention_ref import write_kv_ref
    from hybridkv.kernels.write_kv_cpu import write_kv_cpu

    g = torch.Generator().manual_seed(8)
    pool = torch.randn(9, 2, 8, 2, 24, generator=g)[..., :16]
    slots = torch.randperm(9 * 8, generator=g)[:12]
    k, v = torch.randn(2, 12, 2, 16, generator=g)
    want = write_kv_ref(k, v, pool.clone(), slots)
    plans = {}
    got = write_kv_cpu(k, v, pool, slots, plan_cache=plans)
    assert not pool.is_contiguous() and torch.equal(got, want)


@pytest.mark.parametrize("window", [None, 25, 12, 11])
def test_prefill_from_position_0_matches_reference(window):
    """Chunks with no cached context take SDPA's causal kernel while the window spans the chunk
    (12 tokens under a window of 12 or more), the masked call otherwise (window 11)."""
    reqs = [(12, 12), (1, 30), (12, 12)]
    q, kv, qsl, seq_lens, table = paged_batch(reqs, 8, 2, 2, 16, seed=3)
    want = paged_attention_ref(q, kv, qsl, seq_lens, table, 0.3, sliding_window=window)
    plans = {}
    got = paged_attention_cpu(q, kv, qsl, seq_lens, table, 0.3, sliding_window=window, plan_cache=plans)
    assert rel_err(got, want) < 1e-5
    (plan,) = plans.values()
    assert [grp.causal_only for grp in plan.groups if grp.lmax > 1] == [window != 11] * 2


# (query_len, seq_len): chunks over cached context (C = seq_len - query_len > 0) that start and
# end mid-block, on a block edge and across several blocks, next to chunks from position 0 and
# decodes (q = 1)
RAGGED = [(5, 21), (1, 9), (16, 16), (9, 41), (1, 33), (3, 3), (24, 56), (7, 23), (2, 18)]


@pytest.mark.parametrize("group", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunks_over_cached_context_merge_two_pieces(group, dtype, decode_path):
    """Causal chunks with cached context attend as cached-unmasked + own-causal pieces merged by
    their log-sum-exp; chunks from 0 keep the causal kernel and one-token rows the decode path.
    With the C decode kernel, a chunk of up to SHORT_CHUNK queries after a context runs there too,
    each query as the decode at its position. Unwritten tails and unowned blocks hold NaN."""
    from hybridkv.kernels.attention_cpu import SHORT_CHUNK

    q, kv, qsl, seq_lens, table = paged_batch(RAGGED, 8, 2, group, 32, dtype=dtype, seed=20 + group)
    poison_unread(kv, table, RAGGED, 8)
    want = paged_attention_ref(q, kv, qsl, seq_lens, table, 0.25)
    plans = {}
    got = paged_attention_cpu(q, kv, qsl, seq_lens, table, 0.25, plan_cache=plans)
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 2e-3)
    (plan,) = plans.values()
    native = decode_path == "native" and dtype == torch.float32

    def as_decodes(ql, s):
        return native and 1 < ql <= SHORT_CHUNK and s > ql

    prefill = [(grp.cached, grp.causal_only, grp.hidden is None) for grp in plan.groups if grp.lmax > 1]
    assert prefill == [(s - ql, s == ql, True) for ql, s in RAGGED if ql > 1 and not as_decodes(ql, s)]
    decodes = [grp for grp in plan.groups if grp.lmax == 1]
    if native:  # one C call; no torch decode group
        starts = [0]
        for ql, _ in RAGGED:
            starts.append(starts[-1] + ql)
        rows = [starts[r] for r, (ql, _) in enumerate(RAGGED) if ql == 1]
        rows += [starts[r] + j for r, (ql, s) in enumerate(RAGGED) if as_decodes(ql, s) for j in range(ql)]
        assert not decodes and plan.decodes.rows.tolist() == rows
        assert sum(as_decodes(ql, s) for ql, s in RAGGED) == 4  # (5, 21), (9, 41), (7, 23), (2, 18)
    else:
        assert decodes and all(not grp.sdpa and grp.cached == 0 for grp in decodes) and plan.decodes is None


@pytest.mark.parametrize("opts", [dict(sliding_window=10), dict(soft_cap=3.0), dict(causal=False)])
def test_chunks_over_context_keep_the_old_path_outside_plain_causal(opts):
    """A window, a soft cap or non-causal attention never takes the two-piece merge."""
    q, kv, qsl, seq_lens, table = paged_batch(RAGGED, 8, 2, 2, 32, seed=31)
    want = paged_attention_ref(q, kv, qsl, seq_lens, table, 0.25, **opts)
    plans = {}
    assert rel_err(paged_attention_cpu(q, kv, qsl, seq_lens, table, 0.25, plan_cache=plans, **opts),
                   want) < 1e-5
    assert all(grp.cached == 0 for plan in plans.values() for grp in plan.groups)


def test_without_the_flash_lse_op_chunks_keep_the_mask(monkeypatch):
    """Older torch (no _scaled_dot_product_flash_attention_for_cpu): the boolean-mask SDPA call
    (the C kernel off, which would take the short chunks)."""
    import hybridkv.kernels.attention_cpu as mod

    monkeypatch.setattr(mod, "_FLASH_WITH_LSE", None)
    q, kv, qsl, seq_lens, table = paged_batch(RAGGED, 8, 2, 2, 32, seed=32)
    want = paged_attention_ref(q, kv, qsl, seq_lens, table, 0.25)
    plans = {}
    with native_cpu.forced_off():
        got = paged_attention_cpu(q, kv, qsl, seq_lens, table, 0.25, plan_cache=plans)
    assert rel_err(got, want) < 1e-5
    masked = [grp for plan in plans.values() for grp in plan.groups if grp.sdpa and not grp.causal_only]
    assert len(masked) == 5 and all(grp.cached == 0 and grp.hidden is not None for grp in masked)
