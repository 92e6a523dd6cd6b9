"""One-token decodes of CPU paged attention over a quantized KV pool, read in place (no staging).

A quantized pool (hybridkv/cache_dtype.py) keeps each token's key and value vector of a head as
one-byte codes and a float32 scale: `[num_blocks, 2, bs, Hkv, nbytes]` uint8. A step of decodes
writes each request's new K/V and attends over its keys; here the new K/V are first computed in
float (`fresh` [T, 2, 1, Hkv, D]: the write kernels' own pages, one token a block), then
`kernels/native/paged_attention.c:paged_decode_attention_q` encodes them into the pool (the bytes
a step that kept them in float pages and encoded them after would write) and attends over the
pool's codes decoded block by block into scratch, the new token read from `fresh` at full
precision: the float arithmetic of paged_decode_attention on decoded pages, value for value
(tests/kernels/test_attention_decode_quantized.py holds it to that torch reference).

`layout` is a hybridkv.cache_dtype.QuantLayout of one head's vector (not imported: kernels import
nothing of the memory side). Used when `usable` says so; otherwise the caller decodes the pages.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from . import quantize
from .attention_decode_native import NativeDecodes
from .native_args import F32, I64, CFunction, Ptr, f32, i32, i64

PAGED_DECODE_ATTENTION_Q = CFunction(
    "paged_attention", "paged_decode_attention_q", I64,
    q=f32("T", "hkv * group", "d", strides=("q_tok", "q_head", 1)), q_tok=I64, q_head=I64,
    kv=Ptr(torch.uint8, ("num_blocks", 2, "bs", "hkv", "nbytes")), num_blocks=I64, nbytes=I64, code_bytes=I64,
    fp8_values=f32(256, optional=True), fresh=f32("T", "2 * hkv * d"), fresh_tok=I64, slot_mapping=i64("T"),
    table=Ptr(torch.int32, ("R", "W"), ("table_row", 1)), table_row=I64, seq_lens=i32("R"),
    reqs=i32("n"), rows=i32("n"), n=I64, hkv=I64, group=I64, d=I64, bs=I64,
    scale=F32, soft_cap=F32, window=I64, sinks=f32("hkv * group", optional=True),
    out=f32("T", "hkv * group", "d", strides=("out_tok", "out_head", 1)), out_tok=I64, out_head=I64)


def _pool_ok(pool: torch.Tensor, layout) -> bool:
    """pool [num_blocks, 2, bs, Hkv, nbytes] uint8, contiguous, of items of one head's vector (int8 or fp8)."""
    return (pool.dtype == torch.uint8 and pool.dim() == 5 and pool.is_contiguous() and pool.shape[1] == 2
            and pool.shape[-1] == layout.nbytes and len(layout.shape) == 1 and layout.dtype in ("int8", "fp8_e4m3"))


def usable(pool: torch.Tensor, layout) -> bool:
    """Whether a step's decodes over `pool` ([num_blocks, 2, bs, Hkv, nbytes] uint8, contiguous)
    can run here: on the CPU, the kernels built, a layout of one head's vector (int8 or fp8)."""
    return (pool.is_cpu and _pool_ok(pool, layout) and PAGED_DECODE_ATTENTION_Q.available()
            and quantize.ENCODE_SCATTER.available())


def reads_in_place(pool: torch.Tensor, layout) -> bool:
    """Whether ops.quantized_decode_attention reads `pool` in place on its device: on the CPU when
    `usable`, on CUDA the Triton kernel (attention_decode_quantized_triton.py: head_dim up to 256)."""
    if pool.is_cuda:
        return _pool_ok(pool, layout) and layout.shape[0] <= 256
    return usable(pool, layout)


def page_runs(slots: torch.Tensor, shape) -> torch.Tensor:
    """The first items of the runs (one item a head) of the token slots `slots` in a page tensor of
    `shape` [blocks, parts, block_size, heads, ...]: part after part (key, value), token after token."""
    parts, bs, heads = shape[1], shape[2], shape[3]
    if slots.is_cpu:  # through numpy: a few small ops, ~5x under torch's dispatch of each
        s = slots.numpy().astype(np.int64, copy=False)
        first = (s // bs * parts * bs + s % bs) * heads
        return torch.from_numpy((first[:, None] + np.arange(parts, dtype=np.int64) * (bs * heads)).reshape(-1))
    first = (slots // bs * parts * bs + slots % bs) * heads
    return (first.reshape(-1, 1) + torch.arange(parts, device=slots.device) * (bs * heads)).reshape(-1)


def attend_decodes_quantized(q: torch.Tensor, pool: torch.Tensor, layout, fresh: torch.Tensor,
                             slot_mapping: torch.Tensor, dec: NativeDecodes, scale: float, soft_cap: Optional[float],
                             sliding_window: Optional[int], sinks: Optional[torch.Tensor], out: torch.Tensor) -> None:
    """Encodes each decode's new K/V fresh[rows] ([T, 2, 1, Hkv, D] fp32; its token must be the
    request's last, position seq_len - 1) into the pool at slot_mapping[rows] ([T] int64), the
    bytes quantize.encode gives them, then writes out[rows] ([n, Hq, D] of out [T, Hq, D], fp32)
    for the decodes of `dec`, reading the pool's codes and each decode's new token at full
    precision. ValueError, nothing written, when a block a decode reads or its slot lies outside
    the pool."""
    n = dec.reqs.shape[0]
    if n == 0:
        return
    hkv, d = pool.shape[3], fresh.shape[4]
    sink = None if sinks is None else sinks.detach().to(torch.float32).contiguous()
    status = PAGED_DECODE_ATTENTION_Q.call(
        q=q, q_tok=q.stride(0), q_head=q.stride(1), kv=pool, num_blocks=pool.shape[0], nbytes=layout.nbytes,
        code_bytes=layout.code_bytes, fp8_values=quantize.fp8_values_table() if layout.dtype == "fp8_e4m3" else None,
        fresh=fresh.view(fresh.shape[0], -1), fresh_tok=2 * hkv * d, slot_mapping=slot_mapping,
        table=dec.block_table, table_row=dec.block_table.stride(0), seq_lens=dec.seq_lens,
        reqs=dec.reqs, rows=dec.rows, n=n, hkv=hkv, group=q.shape[1] // hkv, d=d, bs=pool.shape[2],
        scale=scale, soft_cap=0.0 if soft_cap is None else soft_cap,
        window=0 if sliding_window is None else sliding_window, sinks=sink,
        out=out, out_tok=out.stride(0), out_head=out.stride(1))
    if status == -(1 + n):
        raise MemoryError("paged_decode_attention_q: no memory for its scratch buffers")
    if status != 0:
        r = int(dec.reqs[-status - 1])
        raise ValueError(f"request {r}: its block_table row {dec.block_table[r].tolist()} or its new token's slot "
                         f"names a block outside the pool of {pool.shape[0]} blocks (seq_len {int(dec.seq_lens[r])})")


def quantized_decode_attention(q: torch.Tensor, fresh: torch.Tensor, pool: torch.Tensor, layout,
                               slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float, soft_cap: Optional[float], sliding_window: Optional[int],
                               sinks: Optional[torch.Tensor], plan_cache: dict) -> Optional[torch.Tensor]:
    """ops.quantized_decode_attention on CPU: a step of one-token decodes (request r's query is row r
    of q [R, Hq, D] fp32, its new K/V fresh[r] [2, 1, Hkv, D]) over the quantized pool: the new K/V
    encoded into the pool at slot_mapping [R], then attended through block_table [R, W] and
    seq_lens [R] (attend_decodes_quantized, one C call) -> out [R, Hq, D] fp32. None, nothing
    written, when it cannot run here (`usable`, q not fp32). plan_cache: the step's dict, where
    what the step's layers share (slots, the C call's rows) is kept."""
    if not usable(pool, layout) or q.dtype != torch.float32 or not q.is_cpu or fresh.dtype != torch.float32:
        return None
    key = ("quantized_decodes", id(block_table), id(slot_mapping))
    step = plan_cache.get(key)
    if step is None:
        R = q.shape[0]
        step = plan_cache[key] = (slot_mapping.to(torch.int64).contiguous(), NativeDecodes.build(
            list(range(R)), list(range(R + 1)), seq_lens, block_table), block_table, slot_mapping)  # (kept: their ids)
    slots, dec = step[0], step[1]
    out = torch.empty(q.shape, dtype=torch.float32)
    attend_decodes_quantized(q, pool, layout, fresh, slots, dec, scale, soft_cap, sliding_window, sinks, out)
    return out
