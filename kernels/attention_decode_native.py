"""One-token decodes of CPU paged attention in C, read straight from the paged pool.

The torch path (kernels/attention_cpu.py) gathers each bucket's KV blocks into a new tensor and
multiplies that copy twice (a read, a write and two more reads of all the KV; the gather and the
two `bmm`s were ~85% of a Llama decode step's attention). `kernels/native/paged_attention.c`
makes one pass over each request's keys, block by block (online softmax), reading each K and V
row once, in place through the block table, for every query head of its GQA group, with fp32
accumulation; one C call per layer serves every decode of the step. It supports what the torch
path does for decodes: scale, sliding window, soft cap and sinks. Measured in BENCHMARKS.md
(issue 12) with benchmarks/bench_attention_decode_cpu.py.

Used when the kernel builds here (kernels/native_cpu.py; `HYBRIDKV_CPU_NATIVE=0` or
`native_cpu.forced_off()` turn it off), q and the pool are fp32 and their head_dim is contiguous;
otherwise the torch path runs. Checked against the reference in tests/kernels/test_attention_cpu.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .native_args import F32, I64, CFunction, Ptr, f32, i32

# native/paged_attention.c, declared parameter by parameter (native_args.py)
PAGED_DECODE_ATTENTION = CFunction(
    "paged_attention", "paged_decode_attention", I64,
    q=f32("T", "hkv * group", "d", strides=("q_tok", "q_head", 1)), q_tok=I64, q_head=I64,
    kv=f32("num_blocks", 2, "bs", "hkv", "d", strides=("kv_blk", "kv_half", "kv_pos", "kv_head", 1)),
    num_blocks=I64, kv_blk=I64, kv_half=I64, kv_pos=I64, kv_head=I64,
    table=Ptr(torch.int32, ("R", "W"), ("table_row", 1)), table_row=I64, seq_lens=i32("R"),
    reqs=i32("n"), rows=i32("n"), n=I64, hkv=I64, group=I64, d=I64, bs=I64,
    scale=F32, soft_cap=F32, window=I64, sinks=f32("hkv * group", optional=True),
    out=f32("T", "hkv * group", "d", strides=("out_tok", "out_head", 1)), out_tok=I64, out_head=I64)


def native_decodes_usable(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether this layer's decodes can run in C: the kernel is here, q [T, Hq, D] and the pool
    [num_blocks, 2, bs, Hkv, D] are fp32 CPU tensors with a contiguous head_dim."""
    return (q.dtype == torch.float32 and kv_cache.dtype == torch.float32 and q.is_cpu
            and kv_cache.is_cpu and q.stride(2) == 1 and kv_cache.stride(4) == 1
            and PAGED_DECODE_ATTENTION.available())


@dataclass
class NativeDecodes:
    """What the C call needs about a step's one-token decodes, built once per step (ForwardBatch.
    kernel_plans) and shared by every layer: reqs [n] int32 request indices, rows [n] int32 their
    query rows, block_table [R, W] and seq_lens [R] int32 contiguous (kept alive here)."""

    reqs: torch.Tensor
    rows: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor

    @staticmethod
    def build(decodes: list[int], query_start_loc: list[int], seq_lens: torch.Tensor,
              block_table: torch.Tensor) -> "NativeDecodes":
        """decodes: the requests with one query this step; query_start_loc: qsl as a list."""
        return NativeDecodes(torch.tensor(decodes, dtype=torch.int32),
                             torch.tensor([query_start_loc[r] for r in decodes], dtype=torch.int32),
                             block_table.to(torch.int32).contiguous(),
                             seq_lens.to(torch.int32).contiguous())

    @staticmethod
    def build_rows(rows: list[int], seq_lens: list[int], table_rows: list[int],
                   block_table: torch.Tensor) -> "NativeDecodes":
        """One entry per query row: rows[i] attends to the first seq_lens[i] keys of request
        table_rows[i] (a short chunk's token j sees its context and the chunk's first j + 1 keys:
        exactly what its decode would)."""
        return NativeDecodes(torch.arange(len(rows), dtype=torch.int32), torch.tensor(rows, dtype=torch.int32),
                             block_table.index_select(0, torch.tensor(table_rows)).to(torch.int32).contiguous(),
                             torch.tensor(seq_lens, dtype=torch.int32))


def attend_decodes(q, kv_cache, dec: NativeDecodes, scale: float, soft_cap: Optional[float],
                   sliding_window: Optional[int], sinks: Optional[torch.Tensor], out: torch.Tensor):
    """Writes out[rows] ([n, Hq, D] of out [T, Hq, D], fp32) for the decodes of `dec`. Raises
    ValueError when a block-table entry a decode reads lies outside the pool."""
    n = dec.reqs.shape[0]
    if n == 0:
        return
    hkv, d = kv_cache.shape[3], kv_cache.shape[4]
    sink = None if sinks is None else sinks.detach().to(torch.float32).contiguous()
    st = kv_cache.stride()
    status = PAGED_DECODE_ATTENTION.call(
        q=q, q_tok=q.stride(0), q_head=q.stride(1),
        kv=kv_cache, num_blocks=kv_cache.shape[0], kv_blk=st[0], kv_half=st[1], kv_pos=st[2], kv_head=st[3],
        table=dec.block_table, table_row=dec.block_table.stride(0), seq_lens=dec.seq_lens,
        reqs=dec.reqs, rows=dec.rows, n=n, hkv=hkv, group=q.shape[1] // hkv, d=d, bs=kv_cache.shape[2],
        scale=scale, soft_cap=0.0 if soft_cap is None else soft_cap,
        window=0 if sliding_window is None else sliding_window, sinks=sink,
        out=out, out_tok=out.stride(0), out_head=out.stride(1))
    if status == -(1 + n):
        raise MemoryError("paged_decode_attention: no memory for its scratch buffers")
    if status != 0:
        r = int(dec.reqs[-status - 1])
        raise ValueError(f"request {r}: its block_table row {dec.block_table[r].tolist()} names a block "
                         f"outside the pool of {kv_cache.shape[0]} blocks (seq_len {int(dec.seq_lens[r])})")
