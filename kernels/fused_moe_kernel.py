"""Triton fused MoE: a grouped GEMM over expert-sorted blocks of (token, slot) pairs.

The layout of vLLM's / SGLang's fused_moe: pairs sorted by expert and padded to BLOCK_M per expert
(moe_sort.sort_by_expert), one program per (block of pairs, N tile), the block's expert read from
`block_expert`. Two launches: gate_up with silu-and-mul fused (two accumulators, the gate and the
up rows of the same N tile; or up alone with relu2 for ungated experts), then down with the
routing weight applied. Each pair's row is written
once, so the k rows of a token are summed afterwards without atomics (deterministic).
No host sync: grid sizes follow from shapes; programs past `num_padded` return at once.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .fused_moe_ref import check_fused_moe_inputs
from .moe_sort import sort_by_expert

ACTIVATIONS = {"silu": 0, "relu2": 1}  # name -> the kernel's ACT


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weight_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    N, num_pairs,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    K: tl.constexpr,  # a constexpr loop bound: Triton 3.6's interpreter takes no argument there
    PAIRS_PER_A_ROW: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """c[pair, n] = sum_k a[pair // PAIRS_PER_A_ROW, k] * b[expert, n, k], then by ACT (-1: none,
    0: silu, 1: relu2) act(c), times the up row's (at n + N) sum when GATED, times weight[pair]
    when MUL_WEIGHT."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    row_ok = pair < num_pairs
    a_row = (pair // PAIRS_PER_A_ROW).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    b_base = b_ptr + expert * stride_be
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b_mask = k_ok[:, None] & n_ok[None, :]
        b = tl.load(b_base + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk,
                    mask=b_mask, other=0.0)
        acc += tl.dot(a, b, input_precision="ieee")
        if GATED:
            b_up = tl.load(b_base + (offs_n[None, :] + N) * stride_bn + offs_k[:, None] * stride_bk,
                           mask=b_mask, other=0.0)
            acc_up += tl.dot(a, b_up, input_precision="ieee")
    if ACT == 0:
        acc = acc / (1.0 + tl.exp(-acc))
    elif ACT == 1:
        acc = tl.maximum(acc, 0.0)
        acc = acc * acc
    if GATED:
        acc = acc * acc_up
    if MUL_WEIGHT:
        w = tl.load(weight_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    c = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Rows per program: 16 when experts get a few pairs each (decode), 64 when they get many."""
    return 16 if num_pairs <= 4 * num_experts else 64


def _launch(a, b, c, weight, blocks, n, k, pairs_per_a_row, act, gated, mul_weight):
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64 if a.element_size() <= 2 else 32, max(16, triton.next_power_of_2(k)))
    grid = (blocks.block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, b, c, weight, blocks.sorted_pairs, blocks.block_expert, blocks.num_padded,
        n, blocks.num_pairs,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        K=k, PAIRS_PER_A_ROW=pairs_per_a_row, ACT=act, GATED=gated, MUL_WEIGHT=mul_weight,
        BLOCK_M=blocks.block, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )


def fused_moe_triton(hidden, w_gate_up, w_down, topk_weights, topk_ids, activation: str = "silu",
                     gated: bool = True):
    """Triton version of `fused_moe_ref` (fp16 / bf16 / fp32): hidden [T, H], w_gate_up [E, 2I, H]
    ([E, I, H] when not gated), w_down [E, H, I], topk_weights / topk_ids [T, k] -> [T, H] in
    hidden's dtype. Expert ids are trusted (they come from a top-k; checking them would be a host
    sync)."""
    check_fused_moe_inputs(hidden, w_gate_up, w_down, topk_weights, topk_ids, gated)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}; the Triton fused MoE supports "
                         f"{sorted(ACTIVATIONS)} (HYBRIDKV_BACKEND=torch runs any)")
    if not (hidden.dtype == w_gate_up.dtype == w_down.dtype):
        raise ValueError(f"hidden, w_gate_up and w_down must share a dtype; got {hidden.dtype}, "
                         f"{w_gate_up.dtype}, {w_down.dtype}")
    T, H = hidden.shape
    E, I, k = w_gate_up.shape[0], w_down.shape[2], topk_ids.shape[1]
    if T == 0:
        return hidden.new_zeros(0, H)
    blocks = sort_by_expert(topk_ids, E, block_m_for(T * k, E))
    weights = topk_weights.reshape(-1).contiguous()
    inner = torch.empty(T * k, I, dtype=hidden.dtype, device=hidden.device)
    out = torch.empty(T * k, H, dtype=hidden.dtype, device=hidden.device)
    guard = torch.cuda.device(hidden.device) if hidden.is_cuda else contextlib.nullcontext()
    with guard:
        _launch(hidden, w_gate_up, inner, weights, blocks, I, H, k, ACTIVATIONS[activation],
                gated=gated, mul_weight=False)
        _launch(inner, w_down, out, weights, blocks, H, I, 1, -1, gated=False, mul_weight=True)
    if k == 1:
        return out
    return out.view(T, k, H).sum(dim=1, dtype=torch.float32).to(hidden.dtype)
