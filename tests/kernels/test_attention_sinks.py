"""Attention sinks (GPT-OSS): a per-head logit in the softmax denominator. The reference against
transformers' own GPT-OSS eager attention on a dense batch; the CPU path against the reference on
mixed paged batches (decodes, prefill chunks, sliding windows)."""
import types

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from hybridkv.kernels.attention_cpu import paged_attention_cpu
from hybridkv.kernels.attention_ref import paged_attention_ref

# (query_len, seq_len): decodes at block edges, prefill chunks from 0 and after a context, an idle request
MIXED = [(1, 1), (1, 17), (5, 33), (16, 16), (0, 10), (15, 31), (1, 64), (40, 70)]


def paged_batch(reqs, bs, hkv, group, d, seed=0):
    """Random q [T, Hq, D] (two padding rows), a pool of shuffled blocks, a block table whose
    unused columns hold random ids, query_start_loc, seq_lens."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-s // bs) for _, s in reqs]
    num_blocks = sum(need) + 4
    kv = torch.randn(num_blocks, 2, bs, hkv, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.randint(0, num_blocks, (len(reqs), max(need) + 1), generator=g, dtype=torch.int32)
    starts = [sum(need[:r]) for r in range(len(reqs))]
    for r, n in enumerate(need):
        table[r, :n] = perm[starts[r]:starts[r] + n]
    q = torch.randn(sum(ql for ql, _ in reqs) + 2, hkv * group, d, generator=g)
    qsl = torch.tensor([0] + [ql for ql, _ in reqs]).cumsum(0).to(torch.int32)
    return q, kv, qsl, torch.tensor([s for _, s in reqs], dtype=torch.int32), table


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("window", [None, 5])
def test_reference_equals_transformers_gpt_oss_attention(window):
    g = torch.Generator().manual_seed(7)
    hkv, group, d, n, bs = 2, 3, 8, 13, 4
    q = torch.randn(n, hkv * group, d, generator=g)
    k, v = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
    sinks = torch.randn(hkv * group, generator=g) * 2
    nblk = -(-n // bs)
    kv = torch.zeros(nblk + 1, 2, bs, hkv, d)
    perm = torch.randperm(nblk, generator=g) + 1  # shuffled blocks, block 0 unused
    for p in range(n):
        kv[perm[p // bs], 0, p % bs], kv[perm[p // bs], 1, p % bs] = k[p], v[p]
    got = paged_attention_ref(q, kv, torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                              perm[None].to(torch.int32), d ** -0.5, sliding_window=window, sinks=sinks)
    pos = torch.arange(n)
    visible = pos[:, None] >= pos[None, :]
    if window is not None:
        visible &= pos[:, None] - pos[None, :] < window
    mask = torch.zeros(n, n).masked_fill(~visible, float("-inf"))[None, None]
    module = types.SimpleNamespace(num_key_value_groups=group, sinks=sinks, training=False)
    want, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                      v.transpose(0, 1)[None], mask, d ** -0.5)
    assert rel_err(got, want[0]) < 1e-5


@pytest.mark.parametrize("opts", [dict(), dict(sliding_window=7), dict(soft_cap=5.0)])
def test_cpu_path_matches_reference_with_sinks(opts):
    q, kv, qsl, seq_lens, table = paged_batch(MIXED, 8, 2, 2, 16, seed=11)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(3)) * 3
    want = paged_attention_ref(q, kv, qsl, seq_lens, table, 0.25, sinks=sinks, **opts)
    got = paged_attention_cpu(q, kv, qsl, seq_lens, table, 0.25, sinks=sinks, **opts)
    assert rel_err(got, want) < 1e-5
    plain = paged_attention_ref(q, kv, qsl, seq_lens, table, 0.25, **opts)
    assert rel_err(got, plain) > 1e-2  # the sinks change the output: this test can fail


def test_sinks_of_a_wrong_shape_are_refused():
    q, kv, qsl, seq_lens, table = paged_batch(MIXED, 8, 2, 2, 16)
    for fn in (paged_attention_ref, paged_attention_cpu):
        with pytest.raises(ValueError, match=r"sinks has shape \(3,\); expected one logit per query head: \(4,\)"):
            fn(q, kv, qsl, seq_lens, table, 0.25, sinks=torch.zeros(3))


@pytest.mark.slow  # interpreted Triton
@pytest.mark.parametrize("opts", [dict(), dict(sliding_window=7), dict(num_kv_splits=3, max_seq_len=70)])
def test_triton_kernel_matches_reference_with_sinks(opts):
    from hybridkv.kernels.paged_attention_kernel import paged_attention_triton  # interpreted on CPU

    reqs = [(1, 17), (5, 33), (0, 10), (1, 70), (12, 12)]
    q, kv, qsl, seq_lens, table = paged_batch(reqs, 16, 2, 2, 16, seed=21)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(5)) * 3
    got = paged_attention_triton(q, kv, qsl, seq_lens, table, 0.25, sinks=sinks, **opts)
    ref_opts = {k: v for k, v in opts.items() if k == "sliding_window"}
    want = paged_attention_ref(q, kv, qsl, seq_lens, table, 0.25, sinks=sinks, **ref_opts)
    n = int(qsl[-1])
    assert rel_err(got[:n], want[:n]) < 1e-4
    plain = paged_attention_ref(q, kv, qsl, seq_lens, table, 0.25, **ref_opts)
    assert rel_err(got[:n], plain[:n]) > 1e-2
