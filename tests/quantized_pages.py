"""Quantized KV pools for the decode-attention kernel tests (tests/kernels/test_attention_decode_quantized*.py):
a random case, the pool a step should leave, and the float pages a staged step attends over."""
import math

import torch

from hybridkv.cache_dtype import QuantLayout


def case(lens, bs, hkv, group, d, dtype, seed):
    """A quantized pool whose requests' blocks are shuffled among spare ones (spare blocks and the
    unwritten tails hold NaN rows), q, the new K/V `fresh` of each request's last token, the block
    table (entries past a request's blocks: any block) and the slot of that token."""
    g = torch.Generator().manual_seed(seed)
    layout = QuantLayout(dtype, (d,), 0)
    need = [math.ceil(n / bs) for n in lens]
    num_blocks = sum(need) + 3
    vals = torch.randn(num_blocks, 2, bs, hkv, d, generator=g)
    vals = vals * torch.exp(torch.empty(num_blocks, 2, bs, hkv, 1).uniform_(-4, 4, generator=g))  # many scales
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.randint(0, num_blocks, (len(lens), max(need) + 1), generator=g, dtype=torch.int32)
    used = 0
    for r, n in enumerate(need):
        table[r, :n] = perm[used:used + n].to(torch.int32)
        used += n
    vals[perm[used:]] = float("nan")  # blocks no request reads
    for r, n in enumerate(lens):  # the unwritten tail of each last block, the new token's slot included
        vals[table[r, (n - 1) // bs], :, (n - 1) % bs:] = float("nan")
    fresh = torch.randn(len(lens), 2, 1, hkv, d, generator=g) * torch.exp(
        torch.empty(len(lens), 2, 1, hkv, 1).uniform_(-4, 4, generator=g))
    slots = torch.tensor([int(table[r, (n - 1) // bs]) * bs + (n - 1) % bs for r, n in enumerate(lens)])
    q = torch.randn(len(lens), hkv * group, d, generator=g)
    return layout, layout.encode(vals), fresh, slots, q, table


def written_pool(layout, pool, fresh, slots, bs):
    """The pool with each new K and V vector encoded (the layout's torch path) at its token's slot."""
    want = pool.clone()
    for t, s in enumerate(slots.tolist()):
        want[s // bs, :, s % bs] = layout.encode(fresh[t, :, 0])
    return want


def reference_pages(layout, pool, fresh, slots, bs):
    """The float pages a staged step attends over: the pool decoded, the new tokens at full precision."""
    pages = layout.decode(pool)
    for t, s in enumerate(slots.tolist()):
        pages[s // bs, :, s % bs] = fresh[t, :, 0]
    return pages
