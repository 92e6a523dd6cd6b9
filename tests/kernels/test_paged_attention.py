"""Paged attention: the torch reference against torch SDPA (with transformers' mask functions),
then the Triton kernel (interpreted on CPU) against the reference."""
import math

import pytest
import torch
import torch.nn.functional as F
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

import hybridkv.kernels as K
from hybridkv.kernels.attention_cpu import paged_attention_cpu
from hybridkv.kernels.attention_ref import paged_attention_ref
from hybridkv.kernels.paged_attention_kernel import paged_attention_triton

# (query_len, seq_len): lengths 1, block boundaries +-1 for bs 16 and 32, an idle request (0)
MIXED = [(1, 1), (1, 17), (5, 33), (16, 16), (0, 10), (15, 31), (3, 32)]
DECODE = [(1, 1), (1, 15), (1, 16), (1, 33), (1, 47)]
PREFILL = [(17, 17), (33, 40), (2, 2)]


def make_batch(reqs, bs, hkv, group, d, dtype, seed=0, pad_rows=0):
    """A random paged batch plus, per request, its full Q and contiguous K, V (the oracle's view).

    Blocks are handed out in shuffled order with spare blocks in between, and unused block-table
    columns point at random live blocks, so any indexing slip reads wrong (non-zero) data.
    """
    g = torch.Generator().manual_seed(seed)
    hq = hkv * group
    need = [math.ceil(s / bs) for _, s in reqs]
    num_blocks = sum(need) + 5
    kv = torch.randn(num_blocks, 2, bs, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(need) + 1
    table = torch.randint(0, num_blocks, (len(reqs), max_blocks), generator=g, dtype=torch.int32)
    full, qs, used = [], [], 0
    for r, (qlen, slen) in enumerate(reqs):
        blocks = perm[used:used + need[r]]
        used += need[r]
        table[r, :need[r]] = blocks.to(torch.int32)
        k = torch.randn(slen, hkv, d, generator=g).to(dtype)
        v = torch.randn(slen, hkv, d, generator=g).to(dtype)
        pos = torch.arange(slen)
        kv[blocks[pos // bs], 0, pos % bs] = k
        kv[blocks[pos // bs], 1, pos % bs] = v
        q_full = torch.randn(slen, hq, d, generator=g).to(dtype)
        full.append((q_full, k, v))
        qs.append(q_full[slen - qlen:])
    qs.append(torch.randn(pad_rows, hq, d, generator=g).to(dtype))
    q = torch.cat(qs)
    qsl = torch.tensor([0] + [ql for ql, _ in reqs], dtype=torch.int32).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for _, s in reqs], dtype=torch.int32)
    return q, kv, qsl, seq_lens, table, full


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def sdpa_oracle(full, reqs, scale, window=None):
    """Per request: SDPA over the whole sequence with transformers' causal / sliding-window mask
    function, keeping the last query_len rows (the positions the paged call asks for)."""
    outs = []
    for (q, k, v), (qlen, slen) in zip(full, reqs):
        fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
        idx = torch.arange(slen)
        mask = fn(0, 0, idx[:, None], idx[None, :])
        o = F.scaled_dot_product_attention(
            q.double().transpose(0, 1), k.double().transpose(0, 1), v.double().transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=True)
        outs.append(o.transpose(0, 1)[slen - qlen:])
    return torch.cat(outs)


@pytest.mark.parametrize("d,group,window", [
    *[(d, g, w) for d in (64, 80, 96, 128, 256) for g in (1, 4, 8) for w in (None, 7)],
    (64, 4, 1), (64, 4, 40),  # a window of one key; a window wider than most sequences
])
def test_ref_matches_sdpa(d, group, window):
    reqs = MIXED
    q, kv, qsl, seq_lens, table, full = make_batch(reqs, 16, 2, group, d, torch.float32, seed=d)
    scale = d ** -0.5
    out = paged_attention_ref(q, kv, qsl, seq_lens, table, scale, sliding_window=window)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, sdpa_oracle(full, reqs, scale, window)) < 1e-5


def test_ref_non_causal_matches_sdpa():
    reqs = [(3, 20), (1, 1), (16, 16)]
    q, kv, qsl, seq_lens, table, full = make_batch(reqs, 16, 2, 4, 64, torch.float32, seed=3)
    out = paged_attention_ref(q, kv, qsl, seq_lens, table, 0.1, causal=False)
    want = torch.cat([F.scaled_dot_product_attention(
        fq[s - ql:].transpose(0, 1), fk.transpose(0, 1), fv.transpose(0, 1), scale=0.1,
        enable_gqa=True).transpose(0, 1) for (fq, fk, fv), (ql, s) in zip(full, reqs)])
    assert rel_err(out, want) < 1e-5


def test_ref_soft_cap_matches_plain_math():
    reqs = [(4, 20), (1, 9)]
    hkv, group, d, cap, scale = 2, 2, 64, 3.0, 0.5  # scale 0.5 pushes logits well into the cap
    q, kv, qsl, seq_lens, table, full = make_batch(reqs, 16, hkv, group, d, torch.float32, seed=5)
    out = paged_attention_ref(q, kv, qsl, seq_lens, table, scale, soft_cap=cap)
    rows = []
    for (fq, fk, fv), (ql, s) in zip(full, reqs):
        for i in range(s - ql, s):
            for h in range(hkv * group):
                kh = h // group
                dots = [float(fq[i, h].double() @ fk[j, kh].double()) for j in range(i + 1)]
                logits = [cap * math.tanh(scale * x / cap) for x in dots]
                top = max(logits)
                w = [math.exp(x - top) for x in logits]
                o = sum(wj * fv[j, kh].double() for j, wj in enumerate(w)) / sum(w)
                rows.append(o)
    want = torch.stack(rows).reshape(-1, hkv * group, d)
    assert rel_err(out, want) < 1e-5


# Triton (interpreted) against the reference. Sizes stay tiny: the interpreter is slow.
TOL = {torch.float32: 1e-4, torch.float16: 2e-3}


def check_triton(reqs, bs, hkv, group, d, dtype, seed=0, pad_rows=0, **kw):
    q, kv, qsl, seq_lens, table, _ = make_batch(reqs, bs, hkv, group, d, dtype, seed, pad_rows)
    scale = d ** -0.5
    got = paged_attention_triton(q, kv, qsl, seq_lens, table, scale, **kw)
    for launch_only in ("max_query_len", "max_seq_len", "num_kv_splits"):
        kw.pop(launch_only, None)
    want = paged_attention_ref(q, kv, qsl, seq_lens, table, scale, **kw)
    n = int(qsl[-1])
    assert got.dtype == dtype and got.shape == q.shape
    assert want[:n].abs().max() > 0
    err = rel_err(got[:n], want[:n])
    assert err < TOL[dtype], f"rel err {err:.2e} >= {TOL[dtype]:.0e}"


@pytest.mark.slow  # interpreted Triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("window", [None, 7])
def test_triton_mixed_batch(dtype, group, window):
    check_triton(MIXED, 16, 2, group, 64, dtype, seed=group, pad_rows=2, sliding_window=window)


@pytest.mark.slow  # interpreted Triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_head_dim_128_block_32(dtype):
    check_triton(MIXED, 32, 1, 4, 128, dtype, seed=11, sliding_window=20, soft_cap=2.0)


@pytest.mark.slow  # interpreted Triton
@pytest.mark.parametrize("d", [80, 96, 256])
def test_triton_padded_head_dims(d):
    check_triton([(3, 18), (1, 33)], 16, 1, 2, d, torch.float32, seed=d)


@pytest.mark.slow  # interpreted Triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_soft_cap(dtype):
    check_triton(MIXED, 16, 1, 4, 64, dtype, seed=7, soft_cap=1.5)


@pytest.mark.slow  # interpreted Triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_window_skips_leading_tiles(dtype):
    # windows starting at key 127, one below a 64-key tile edge: skipping one tile too many fails
    reqs = [(3, 150), (1, 148), (1, 64), (2, 65)]
    check_triton(reqs, 16, 1, 2, 64, dtype, seed=14, sliding_window=21)


@pytest.mark.slow  # interpreted Triton
def test_triton_decode_only():
    check_triton(DECODE, 16, 2, 4, 64, torch.float16, seed=8, max_query_len=1)


@pytest.mark.slow  # interpreted Triton
@pytest.mark.parametrize("window", [None, 5])
def test_triton_prefill_tile_of_64_rows(window):
    # max_query_len * group >= 64 selects the 64-row tile (16 tokens x 4 heads)
    check_triton(PREFILL, 16, 1, 4, 64, torch.float32, seed=9, max_query_len=33,
                 sliding_window=window)


@pytest.mark.slow  # interpreted Triton
def test_triton_group_not_dividing_tile():
    # group 3: 16-row tile holds 5 tokens x 3 heads; row 15 must be masked off
    check_triton(MIXED, 16, 2, 3, 64, torch.float32, seed=10)


@pytest.mark.slow  # interpreted Triton
def test_triton_non_causal():
    check_triton([(3, 20), (1, 1), (16, 16)], 16, 1, 4, 64, torch.float32, seed=12, causal=False)


# Split-KV decode: ragged contexts of 1, block +-1 and several tiles, so some shares are empty.
SPLIT_DECODE = [(1, 1), (1, 15), (1, 16), (1, 17), (1, 33), (1, 129), (1, 200)]


@pytest.mark.parametrize("dtype,group,window,cap,splits", [
    (torch.float32, 1, None, None, 2), (torch.float16, 4, None, None, 5),
    (torch.float16, 8, 7, None, 3), (torch.float32, 4, 50, 1.5, 4),
    (torch.float16, 2, None, 2.0, 9),
])
@pytest.mark.slow  # interpreted Triton
def test_triton_split_kv_decode(dtype, group, window, cap, splits):
    check_triton(SPLIT_DECODE, 16, 2, group, 64, dtype, seed=30 + splits, max_query_len=1,
                 max_seq_len=200, num_kv_splits=splits, sliding_window=window, soft_cap=cap)


@pytest.mark.slow  # interpreted Triton
def test_triton_split_kv_mixed_batch_block_32():
    # forced splits also hold for prefill rows (a share may see no key for some rows)
    check_triton(MIXED, 32, 1, 4, 128, torch.float32, seed=31, num_kv_splits=3, sliding_window=20)


def test_kv_splits_rule():
    from hybridkv.kernels.split_kv import MAX_SPLITS, kv_splits
    assert kv_splits(1, 8, 1, 32768, 132) == MAX_SPLITS == 32  # batch 1 x 32k: 8 programs alone
    assert kv_splits(4, 8, 1, 4096, 132) == 8  # 32 programs, 4k keys: 8 shares of 512
    assert kv_splits(64, 8, 1, 4096, 132) == 1  # 512 programs fill 132 SMs
    assert kv_splits(1, 8, 16, 32768, 132) == 1  # prefill in the batch
    assert kv_splits(1, 8, 1, 1000, 132) == 1  # short context
    assert kv_splits(1, 8, 1, None, 132) == 1  # unknown length: no host sync to find it


@pytest.mark.slow  # interpreted Triton
def test_auto_split_kv_on_long_decode(monkeypatch):
    """The launcher applies the rule by itself: batch 1 x 1100 keys splits (here 2 shares)."""
    import hybridkv.kernels.paged_attention_kernel as pak
    chosen = []
    real = pak.kv_splits
    monkeypatch.setattr(pak, "kv_splits", lambda *a: chosen.append(real(*a)) or chosen[-1])
    check_triton([(1, 1100)], 16, 2, 4, 64, torch.float16, seed=32, max_query_len=1,
                 max_seq_len=1100)
    assert chosen == [2]


@pytest.mark.slow  # interpreted Triton
def test_public_api_dispatches(monkeypatch):
    reqs = [(2, 18), (1, 5)]
    q, kv, qsl, seq_lens, table, full = make_batch(reqs, 16, 1, 4, 64, torch.float32, seed=13)
    want = sdpa_oracle(full, reqs, 0.125)
    for backend in ("torch", "triton"):
        monkeypatch.setenv("HYBRIDKV_BACKEND", backend)
        assert rel_err(K.paged_attention(q, kv, qsl, seq_lens, table, 0.125), want) < 1e-4


def test_errors_name_the_problem():
    q, kv, qsl, seq_lens, table, _ = make_batch([(2, 18)], 16, 2, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_attention_ref(q[:, :3], kv, qsl, seq_lens, table, 1.0)
    with pytest.raises(ValueError, match="query_len 2 > seq_len 1"):
        paged_attention_ref(q, kv, qsl, torch.tensor([1], dtype=torch.int32), table, 1.0)
    with pytest.raises(ValueError, match="block_table has"):
        paged_attention_ref(q, kv, qsl, torch.tensor([99], dtype=torch.int32), table, 1.0)
    with pytest.raises(ValueError, match="multiple of 16"):
        paged_attention_triton(q, kv[:, :, :8], qsl, seq_lens, table, 1.0)
    for bad in (0, 33, 2.0):
        with pytest.raises(ValueError, match=f"num_kv_splits {bad!r} must be an int in 1..32"):
            paged_attention_triton(q, kv, qsl, seq_lens, table, 1.0, num_kv_splits=bad)


# Sliding window, window 24 over blocks of 16: the window edge falls inside a block. Prefill chunks
# whose first query is past the window, decodes far past it, a chunk wider than the window, and
# requests that never leave it.
WINDOW_REQS = [(1, 90), (20, 100), (3, 60), (1, 20), (33, 90), (1, 25)]
IMPLS = {"ref": paged_attention_ref, "cpu": paged_attention_cpu, "triton": paged_attention_triton}


def first_needed_block(qlen, seq_len, window, bs):
    """Blocks before this one hold only keys outside every query's window (p - j >= window)."""
    return max(0, seq_len - qlen - window + 1) // bs


@pytest.mark.parametrize("impl", [i if i != "triton" else pytest.param(i, marks=pytest.mark.slow) for i in IMPLS])
def test_window_matches_transformers_mask(impl):
    """The window is transformers' sliding_window_overlay: key j visible to query p iff p - j < w."""
    q, kv, qsl, seq_lens, table, full = make_batch(WINDOW_REQS, 16, 2, 2, 32, torch.float32, seed=21)
    out = IMPLS[impl](q, kv, qsl, seq_lens, table, 32 ** -0.5, sliding_window=24)
    want = sdpa_oracle(full, WINDOW_REQS, 32 ** -0.5, window=24)
    assert rel_err(out[:int(qsl[-1])], want) < 1e-5
    full_attention = sdpa_oracle(full, WINDOW_REQS, 32 ** -0.5)
    assert rel_err(full_attention, want) > 1e-2  # the window does change these outputs


@pytest.mark.parametrize("impl", [i if i != "triton" else pytest.param(i, marks=pytest.mark.slow) for i in IMPLS])
@pytest.mark.parametrize("garbage", ["large_block", "minus_one", "nan_in_place"])
def test_blocks_outside_the_window_are_never_read(impl, garbage):
    """Block-table entries of blocks wholly outside the window (which the memory manager lets go
    and hands to other requests) may point anywhere: the output does not change, bit for bit."""
    bs, window = 16, 24
    q, kv, qsl, seq_lens, table, _ = make_batch(WINDOW_REQS, bs, 2, 2, 32, torch.float32, seed=22)
    fn = IMPLS[impl]
    want = fn(q, kv, qsl, seq_lens, table, 32 ** -0.5, sliding_window=window)
    firsts = [first_needed_block(ql, s, window, bs) for ql, s in WINDOW_REQS]
    assert sum(firsts) >= 8  # most requests have blocks outside their window
    g = torch.Generator().manual_seed(5)
    kv2, table2 = kv.clone(), table.clone()
    if garbage == "large_block":  # another request's data: finite but huge (q.k overflows fp32)
        kv2 = torch.cat([kv2, torch.randn(1, *kv.shape[1:], generator=g) * 1e30])
        for r, f in enumerate(firsts):
            table2[r, :f] = kv.shape[0]
    elif garbage == "minus_one":  # a table position whose block was let go
        for r, f in enumerate(firsts):
            table2[r, :f] = -1
    else:  # nothing may even multiply them by zero
        for r, ((_, s), f) in enumerate(zip(WINDOW_REQS, firsts)):
            last = math.ceil(s / bs) - 1
            table2[r, last + 1:] = table[r, last]  # unused columns: this row's last block, not a NaN one
            kv2[table[r, :f].long()] = float("nan")
    got = fn(q, kv2, qsl, seq_lens, table2, 32 ** -0.5, sliding_window=window)
    n = int(qsl[-1])
    assert torch.equal(got[:n], want[:n])
