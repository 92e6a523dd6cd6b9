"""Fast torch path for paged attention on CPU: same contract as `attention_ref.paged_attention_ref`.

One-token decodes of fp32 layers go to C in one call per layer when native kernels are available
(kernels/attention_decode_native.py: K/V read once, in place through the block table); what follows
is the torch path, for the rest and for every layer when native kernels are off.

The cost follows the tokens held, not (requests x longest context). One-token decodes are sorted
by the number of blocks they read and cut into buckets whose padding is at most a quarter of their
work (or 16 blocks), so one long request runs in its own bucket instead of making every short one
pay for its length. A bucket gathers its whole blocks with one `index_select` straight into a
`[Hkv, R, S, D]` layout and attends with two batched matmuls, the GQA group folded into the query
rows (no copy of K or V per query head); when its requests read the same keys (one decode, equal
lengths) it attends to exactly those (no mask, no V tail to zero). Prefill chunks (query_len > 1)
run one request at a time through `F.scaled_dot_product_attention` on the same gather: its causal
kernel when the chunk has no cached context; a chunk over C cached keys (full causal attention)
attends in two pieces merged by their log-sum-exp: against the cached keys with no mask, against
its own keys with the causal kernel (both through torch's CPU flash op, which returns the LSE;
2.5x the masked call, see `_FLASH_WITH_LSE`); under a window, a boolean mask. Soft-capped layers take the batched matmul
path for prefill too (SDPA has no soft cap), and so do layers with attention sinks: their output
is scaled by sigmoid(logsumexp - sink), the sink's share of the denominator. Under a sliding window only the blocks from the first
query's window on are gathered: blocks before it may already belong to another request.
Everything that depends only on the step (buckets, block indices, masks, V tails) is one plan,
built by the first attention layer of a step and reused by the others through `plan_cache`
(ForwardBatch.kernel_plans).
Checked against the reference in tests/kernels/test_attention_cpu.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .attention_decode_native import NativeDecodes, attend_decodes, native_decodes_usable
from .attention_ref import check_attention_inputs

# SDPA's CPU flash kernel, returning (out [B, H, L, D], logsumexp [B, H, L] in natural-log units):
# the two pieces of a chunk over cached context merge through it. Older torch lacks it: those
# chunks keep the boolean-mask SDPA call (torch's math path: 148 ms vs 62 ms for the two pieces,
# 1 thread, 1024 new over 1024 cached, 4 heads / 2 KV heads, D 64).
# Chunks of up to this many queries after a context run as decodes in the C kernel: below it the
# chunk path's set-up (gathering the blocks, SDPA's call) costs more than reading the keys once a
# query (a verified draft of k + 1 <= 16 tokens: 0.85 ms a layer through SDPA, 0.15 ms in C)
SHORT_CHUNK = 16
_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _first_block(seq_len: int, qlen: int, bs: int, window) -> int:
    """The first block any of the request's queries can see: blocks before it are never read
    (the memory manager may have let them go and handed them to other requests)."""
    return 0 if window is None else max(0, seq_len - qlen - window + 1) // bs


def decode_buckets(nblocks: list[int], waste: float = 1.25, slack: int = 16) -> list[list[int]]:
    """Indices into `nblocks` (blocks each decode reads), cut into buckets run as one batch each.

    Sorted by length; a bucket takes the next (longest so far) request while its padding
    (count x longest - blocks really read) stays within (waste - 1) times the blocks read or
    within `slack` blocks. Padding is gathered and multiplied like real keys (~8 us a block of 16
    on the 2-core VM), a bucket costs ~20 torch calls (~100-150 us): so padding past ~16 blocks
    costs more than another bucket (measured: 32 decodes of 32-256 tokens, 4.3 ms at waste 2.0,
    3.0 ms at 1.25, 3.5 ms at 1.1).
    """
    order = sorted(range(len(nblocks)), key=nblocks.__getitem__)
    buckets, cur, held = [], [], 0
    for i in order:
        n = nblocks[i]
        pad = n * (len(cur) + 1) - (held + n)
        if cur and pad > max((waste - 1.0) * (held + n), slack):
            buckets.append(cur)
            cur, held = [], 0
        cur.append(i)
        held += n
    return buckets + [cur] if cur else buckets


def _visible(pos, key, seq_len, causal, sliding_window):
    """bool mask [.., L, S]: key j visible to the query at absolute position p."""
    vis = key < seq_len
    if causal:
        vis = vis & (key <= pos)
    if sliding_window is not None:
        vis = vis & (pos - key < sliding_window)
    return vis


@dataclass
class _Group:
    """What a batched attention call over requests `reqs` needs besides q and the pool, built once
    per step (see `attention_plan`) and shared by every layer with the same pool geometry.

    rows: [R*Lmax] query rows (padding points at row 0); out_rows: [n] rows written back and
    keep: [n] their positions in the flat (request, query) output, or None when all are kept;
    blocks: [R*nblk] pool blocks to gather; hidden: [R, Lmax, S] masked keys or None; tail:
    flat (request, key) indices whose V rows are zeroed, or None; n_keys: when every request
    reads the same keys (one request, decodes of equal length), only the first n_keys gathered
    keys are attended (0: all, masked); sdpa: run through SDPA (one request; over the first
    n_keys keys only, since an additive mask cannot hide a non-finite key);
    first_row: when the query rows are first_row, first_row + 1, ... in order (a prefill chunk,
    sorted decodes), q is sliced there instead of gathered; causal_only: a prefill chunk with no
    cached context whose window (if any) spans the chunk: SDPA's own causal mask is the whole mask;
    cached: a causal chunk with no window over this many cached keys (> 0), attended as two pieces
    merged by their log-sum-exp (all cached keys unmasked; its own keys causal), 0 otherwise.
    """

    n_reqs: int
    lmax: int
    nblk: int
    rows: torch.Tensor
    out_rows: torch.Tensor
    keep: Optional[torch.Tensor]
    blocks: torch.Tensor
    hidden: Optional[torch.Tensor]
    tail: Optional[torch.Tensor]
    sdpa: bool = False
    n_keys: int = 0
    first_row: Optional[int] = None
    causal_only: bool = False
    cached: int = 0


def _group(block_table, n_pool_blocks, bs, reqs, starts, qlens, lens, causal, window, sdpa):
    dev = block_table.device
    r_n, lmax = len(reqs), max(qlens)
    firsts = [_first_block(s, n, bs, window) for s, n in zip(lens, qlens)]
    nblk = max(-(-s // bs) - f for s, f in zip(lens, firsts))
    first = torch.tensor(firsts, device=dev)
    cols = (first.view(-1, 1) + torch.arange(nblk, device=dev)).clamp_(max=block_table.shape[1] - 1)
    # unused entries may hold any id (even -1): clamp into the pool, their keys are masked
    blocks = block_table[torch.tensor(reqs, device=dev).view(-1, 1), cols].long()
    blocks = blocks.clamp_(0, n_pool_blocks - 1).view(-1)
    if lmax == 1:
        rows = torch.tensor(starts, device=dev)
        keep = None
    else:
        rows = torch.tensor([[s + i if i < n else 0 for i in range(lmax)]
                             for s, n in zip(starts, qlens)], device=dev).view(-1)
        flat = [r * lmax + i for r, n in enumerate(qlens) for i in range(n)]
        keep = None if len(flat) == r_n * lmax else torch.tensor(flat, device=dev)
    out_rows = rows if keep is None else rows[keep]
    in_order = r_n == 1 or (lmax == 1 and starts == list(range(starts[0], starts[0] + r_n)))
    first_row = starts[0] if in_order else None
    s_n = nblk * bs
    seq = torch.tensor(lens, device=dev).view(-1, 1, 1)
    ql = torch.tensor(qlens, device=dev).view(-1, 1, 1)
    pos = seq - ql + torch.arange(lmax, device=dev).view(1, -1, 1)  # [R, L, 1]
    key = (first * bs).view(-1, 1, 1) + torch.arange(s_n, device=dev).view(1, 1, -1)  # [R, 1, S]
    hidden = ~_visible(pos, key, seq, causal, window).expand(r_n, lmax, s_n)  # [R, L, S]
    if sdpa or len(set(zip(lens, qlens, firsts))) == 1:
        # every request reads the same keys (one request, equal decodes): attend to exactly those,
        # so no tail of another owner's data is read (no V rows to zero, often no mask at all)
        n_keys = lens[0] - firsts[0] * bs
        hidden = hidden[:, :, :n_keys]
        causal_only = sdpa and causal and lens[0] == qlens[0] and (window is None or lmax <= window)
        cached = lens[0] - qlens[0] if (sdpa and causal and window is None and _FLASH_WITH_LSE
                                        is not None) else 0
        no_mask = causal_only or cached > 0
        return _Group(r_n, lmax, nblk, rows, out_rows, keep, blocks,
                      hidden if not no_mask and bool(hidden.any()) else None, None, sdpa, n_keys,
                      first_row, causal_only, cached)
    hidden = hidden if bool(hidden.any()) else None
    # keys past seq_len (a block's unwritten tail, padding columns) hold another owner's data: a
    # zero weight times a non-finite value there would still be NaN, so zero those V rows (only
    # those: a broadcast mask over all of V costs more than the attention)
    tail = (key[:, 0] >= seq[:, 0]).view(-1).nonzero().squeeze(1)
    return _Group(r_n, lmax, nblk, rows, out_rows, keep, blocks, hidden,
                  tail if tail.numel() else None, first_row=first_row)


@dataclass
class StepPlan:
    """A step's attention work: `groups` on the torch path; `decodes`, the one-token decodes the C
    kernel serves in one call (kernels/attention_decode_native.py), or None (they are groups too)."""

    groups: list[_Group]
    decodes: Optional[NativeDecodes] = None
    rows_written: int = 0  # output rows the step writes (fewer than q's rows: zero the rest first)


def attention_plan(query_start_loc, seq_lens, block_table, bs, n_pool_blocks, causal=True,
                   sliding_window=None, soft_cap=None, sinks: bool = False,
                   native: bool = False) -> StepPlan:
    """The step's work: decodes for the C kernel when `native`, else in length buckets (see
    decode_buckets); each prefill chunk alone (through SDPA unless soft-capped or with sinks).
    Checks every request; ValueError names the bad one."""
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    decodes, prefills = [], []
    for r, seq_len in enumerate(lens):
        qlen = qsl[r + 1] - qsl[r]
        if qlen == 0:
            continue
        if qlen > seq_len:
            raise ValueError(f"request {r}: query_len {qlen} > seq_len {seq_len}; seq_len counts "
                             "the cached context plus the new tokens")
        if -(-seq_len // bs) > block_table.shape[1]:
            raise ValueError(f"request {r}: seq_len {seq_len} needs {-(-seq_len // bs)} blocks of "
                             f"{bs}; block_table has {block_table.shape[1]} columns")
        (decodes if qlen == 1 else prefills).append(r)
    # a short chunk after its context (a verified draft, a prompt's tail past a prefix hit): each of
    # its queries as the decode at its position, in the same C call (one key read per query)
    short = [r for r in prefills if lens[r] > qsl[r + 1] - qsl[r] <= SHORT_CHUNK] if native and causal else []
    if short:
        prefills = [r for r in prefills if r not in short]
        entries = [(qsl[r], lens[r], r) for r in decodes]
        entries += [(qsl[r] + j, lens[r] - (qsl[r + 1] - qsl[r]) + 1 + j, r)
                    for r in short for j in range(qsl[r + 1] - qsl[r])]
        native_decodes = NativeDecodes.build_rows(*map(list, zip(*entries)), block_table)
    else:
        native_decodes = NativeDecodes.build(decodes, qsl, seq_lens, block_table) if native and decodes else None
    nblocks = [] if native else [-(-lens[r] // bs) - _first_block(lens[r], 1, bs, sliding_window)
                                 for r in decodes]
    groups = []
    for bucket in decode_buckets(nblocks):
        reqs = [decodes[i] for i in bucket]
        groups.append(_group(block_table, n_pool_blocks, bs, reqs, [qsl[r] for r in reqs],
                             [1] * len(reqs), [lens[r] for r in reqs], causal, sliding_window,
                             False))
    for r in prefills:
        groups.append(_group(block_table, n_pool_blocks, bs, [r], [qsl[r]], [qsl[r + 1] - qsl[r]],
                             [lens[r]], causal, sliding_window, soft_cap is None and not sinks))
    return StepPlan(groups, native_decodes, qsl[-1] - qsl[0])


def _attend(q, kv_cache, grp: _Group, scale, soft_cap, sinks=None):
    """One group: [n, Hq, D] fp32 outputs for grp.out_rows."""
    _, _, bs, hkv, d = kv_cache.shape
    hq = q.shape[1]
    g, r_n, lmax, s_n = hq // hkv, grp.n_reqs, grp.lmax, grp.nblk * bs
    # one index_select of whole blocks from the pool viewed as [2, Hkv, blocks, bs, D]
    kv = kv_cache.permute(1, 3, 0, 2, 4).index_select(2, grp.blocks).view(2, hkv * r_n, s_n, d)
    k, v = (kv[0], kv[1]) if kv.dtype == torch.float32 else (kv[0].float(), kv[1].float())
    if grp.first_row is None:
        qr = q.index_select(0, grp.rows)
    else:  # may be a view of q: nothing below writes into qr
        qr = q[grp.first_row:grp.first_row + r_n * lmax]
    qr = qr if qr.dtype == torch.float32 else qr.float()
    if r_n * lmax == 1:  # one decode: its heads are already (kv head, group) rows
        qr = qr.reshape(hkv, g, d)
    else:
        qr = qr.reshape(r_n, lmax, hkv, g, d).permute(2, 0, 3, 1, 4).reshape(hkv * r_n, g * lmax, d)
    if grp.n_keys:  # the same keys for every request: exactly those
        k, v, s_n = k[:, :grp.n_keys], v[:, :grp.n_keys], grp.n_keys
    if grp.tail is not None:
        v.view(hkv, r_n * s_n, d).index_fill_(1, grp.tail, 0.0)
    if grp.causal_only:  # SDPA's causal kernel, K/V broadcast over the group (~1.9x the masked call)
        o = F.scaled_dot_product_attention(
            qr.view(hkv, g, lmax, d), k[:, None].expand(hkv, g, s_n, d),
            v[:, None].expand(hkv, g, s_n, d), is_causal=True, scale=scale).reshape(hkv, g * lmax, d)
    elif grp.cached:  # cached keys unmasked + own keys causal, merged by log-sum-exp
        c, qg = grp.cached, qr.view(hkv, g, lmax, d)
        o_old, lse_old = _FLASH_WITH_LSE(qg, k[:, None, :c].expand(hkv, g, c, d),
                                         v[:, None, :c].expand(hkv, g, c, d), 0.0, False, scale=scale)
        o_new, lse_new = _FLASH_WITH_LSE(qg, k[:, None, c:].expand(hkv, g, lmax, d),
                                         v[:, None, c:].expand(hkv, g, lmax, d), 0.0, True, scale=scale)
        # (e^lse_old o_old + e^lse_new o_new) / (e^lse_old + e^lse_new), as one lerp: the weight
        # of the cached piece is sigmoid(lse_old - lse_new) (both finite: every row sees its own key)
        o = torch.lerp(o_new, o_old, torch.sigmoid(lse_old - lse_new).unsqueeze(-1)).reshape(hkv, g * lmax, d)
    elif grp.sdpa:  # one request: SDPA with a boolean mask (True = visible)
        mask = None if grp.hidden is None else ~grp.hidden[0].repeat(g, 1)
        o = F.scaled_dot_product_attention(qr, k, v, attn_mask=mask, scale=scale)
    else:
        logits = torch.bmm(qr * scale, k.transpose(1, 2))  # [Hkv*R, G*L, S]
        if soft_cap is not None:
            logits.div_(soft_cap).tanh_().mul_(soft_cap)
        if grp.hidden is not None:
            logits.view(hkv, r_n, g, lmax, s_n).masked_fill_(grp.hidden[None, :, None], float("-inf"))
        o = torch.bmm(torch.softmax(logits, dim=-1), v)  # every real query sees its own key
        if sinks is not None:  # exp(s) joins the denominator: scale by Z / (Z + exp(s))
            lse = torch.logsumexp(logits.view(hkv, r_n, g, lmax, s_n), dim=-1)
            share = torch.sigmoid(lse - sinks.float().view(hkv, 1, g, 1))
            o = o * share.view(hkv * r_n, g * lmax, 1)
    if r_n * lmax == 1:
        return o.reshape(1, hq, d)
    o = o.view(hkv, r_n, g, lmax, d).permute(1, 3, 0, 2, 4).reshape(r_n * lmax, hq, d)
    return o if grp.keep is None else o.index_select(0, grp.keep)


def paged_attention_cpu(q, kv_cache, query_start_loc, seq_lens, block_table, scale, causal=True,
                        sliding_window=None, soft_cap=None, max_query_len=None, max_seq_len=None,
                        plan_cache: Optional[dict] = None, sinks=None):
    """Packed queries over paged KV; inputs, outputs and semantics as `paged_attention_ref`.

    q [T, Hq, D]; kv_cache [num_blocks, 2, bs, Hkv, D]; query_start_loc [R+1]; seq_lens [R];
    block_table [R, max_blocks]. Returns out [T, Hq, D] in q's dtype (rows past qsl[-1] zero).
    plan_cache: a dict that lives for one step (ForwardBatch.kernel_plans); the step's plan is
    built by the first layer and reused by the others with the same pool geometry and options.
    """
    check_attention_inputs(q, kv_cache, query_start_loc, seq_lens, block_table, sliding_window,
                           soft_cap, sinks)
    native = native_decodes_usable(q, kv_cache)
    key = ("paged_attention", kv_cache.shape[2], kv_cache.shape[0], causal, sliding_window,
           soft_cap is None, sinks is None, native)
    plan = None if plan_cache is None else plan_cache.get(key)
    if plan is None:
        plan = attention_plan(query_start_loc, seq_lens, block_table, kv_cache.shape[2],
                              kv_cache.shape[0], causal, sliding_window, soft_cap, sinks is not None,
                              native)
        if plan_cache is not None:
            plan_cache[key] = plan
    groups = plan.groups
    if (plan.decodes is None and len(groups) == 1 and groups[0].first_row == 0
            and groups[0].out_rows.shape[0] == q.shape[0]):
        out = _attend(q, kv_cache, groups[0], scale, soft_cap, sinks)  # every row, in order
        return out if out.dtype == q.dtype else out.to(q.dtype)
    out = torch.empty_like(q) if plan.rows_written == q.shape[0] else torch.zeros_like(q)
    if plan.decodes is not None:  # fp32 (native_decodes_usable): written in place
        attend_decodes(q, kv_cache, plan.decodes, scale, soft_cap, sliding_window, sinks, out)
    for grp in groups:
        out.index_copy_(0, grp.out_rows, _attend(q, kv_cache, grp, scale, soft_cap, sinks).to(q.dtype))
    return out
