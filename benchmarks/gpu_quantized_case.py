"""Quantized caches on the GPU (issue 27 item 4): the Triton kernels that read and write int8 / fp8 pools
in place, checked and timed by benchmarks/gpu_kernels.py.

Checks (CHECKS, run with the other kernels' by gpu_kernel_cases.run_checks): each kernel against the
torch path of the same arithmetic on the same GPU (pools decoded and encoded by
hybridkv.cache_dtype, the float torch references between):
- quantized decode attention: the output, and the pool's bytes (the new K/V must be the torch
  encode's bytes exactly);
- the quantized Mamba2 decode: y, the conv pool's bytes (exact: the window's values follow from its
  inputs alone), and the SSM codes within one step of the reference's (its state is computed in
  another order of float operations, so a value near a rounding boundary may round the other way).
Timings (timing_rows): each against the float kernel it replaces, on the same shapes: decode
attention at batch 64 x 4k (Hq 32, Hkv 8, D 128) against paged_attention_triton on fp32 and bf16
pages, in bytes read per second; the Mamba2 decode at batch 256 (H 64, P 64, N 128) against
conv1d_update_triton + mamba2_state_update_triton + the norm on fp32 pools.
`small` (the CPU dry run) shrinks every size; the kernels run interpreted.
"""
from __future__ import annotations

import math

import torch

from hybridkv.cache_dtype import QuantLayout, conv_layout, state_layout
from hybridkv.kernels import attention_ref, conv1d_ref, mamba2_ref


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def kv_case(dev, gen, cache, lens, bs, hkv, hq, d):
    """A quantized KV pool (blocks handed out shuffled, rows of many magnitudes), q fp32, the new
    K/V `fresh` of each request's last token, its slot, the block table and seq_lens."""
    layout = QuantLayout(cache, (d,), 0)
    need = [math.ceil(n / bs) for n in lens]
    nblocks = sum(need) + 1
    vals = torch.randn(nblocks, 2, bs, hkv, d, generator=gen, device=dev)
    vals *= torch.exp(torch.empty(nblocks, 2, bs, hkv, 1, device=dev).uniform_(-3, 3, generator=gen))
    perm = torch.randperm(nblocks, generator=gen, device=dev).to(torch.int32)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32, device=dev)
    used = 0
    for r, n in enumerate(need):
        table[r, :n] = perm[used:used + n]
        used += n
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    last = (seq_lens - 1).long()
    slots = table.long().gather(1, (last // bs)[:, None])[:, 0] * bs + last % bs
    fresh = torch.randn(len(lens), 2, 1, hkv, d, generator=gen, device=dev) * 3
    q = torch.randn(len(lens), hq, d, generator=gen, device=dev)
    return layout, layout.encode(vals), fresh, slots, q, table, seq_lens


def _attention_check(dtype, dev, gen, small, cache):
    from hybridkv.kernels.attention_decode_quantized_triton import quantized_decode_attention_triton

    lens = [17, 40, 1, 33] if small else [1, 4097, 700, 17, 2000, 255]
    hkv, hq, d, bs = (2, 8, 64, 16) if small else (8, 32, 128, 16)
    layout, pool, fresh, slots, q, table, seq_lens = kv_case(dev, gen, cache, lens, bs, hkv, hq, d)
    pages = layout.decode(pool)
    want_pool = pool.clone()
    flat = want_pool.view(-1, 2, bs, hkv, layout.nbytes)
    flat[slots // bs, :, slots % bs] = layout.encode(fresh[:, :, 0])
    pages[slots // bs, :, slots % bs] = fresh[:, :, 0]
    out = quantized_decode_attention_triton(q, fresh, pool, layout, slots, table, seq_lens, d ** -0.5, None, 100,
                                            None, {})
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32, device=dev)
    want = attention_ref.paged_attention_ref(q, pages, qsl, seq_lens, table, d ** -0.5, sliding_window=100)
    return [(out, want), (pool.float(), want_pool.float())]


def mixer_case(dev, gen, cache, batch, h, p, n, g, k=4):
    """Quantized conv and SSM pools of batch + 1 slots, the layer's weights (Mamba2Mixer's op
    arguments) and in_proj rows; the slots are shuffled, slot 0 (the null slot) not among them."""
    conv_dim = h * p + 2 * g * n
    cl, sl = conv_layout(cache, (conv_dim, k - 1)), state_layout(cache, (h, p, n))
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    conv_q = cl.encode(r(batch + 1, conv_dim, k - 1))
    ssm_q = sl.encode(r(batch + 1, h, p, n) * torch.exp(torch.empty(batch + 1, h, p, 1, device=dev).uniform_(
        -4, 4, generator=gen)))
    slots = (torch.randperm(batch, generator=gen, device=dev) + 1).to(torch.int32)
    weights = dict(num_heads=h, head_dim=p, n_groups=g, conv_weight=r(conv_dim, k), conv_bias=r(conv_dim),
                   A_log=torch.log(torch.rand(h, generator=gen, device=dev) * 15 + 1), dt_bias=r(h) - 3, D=r(h),
                   norm_weight=r(h * p), norm_group=h * p // g, eps=1e-5, norm_mode=1)
    return cl, sl, conv_q, ssm_q, slots, weights, r(batch, h * p + conv_dim + h)


def _float_mixer(proj, slots, conv_f, ssm_f, w, triton_kernels):
    """The float decode between in_proj and out_proj on float pools (updated in place) -> y [B, H P]."""
    from hybridkv.kernels.mamba2_quantized_triton import gated_norm

    h, p, g = w["num_heads"], w["head_dim"], w["n_groups"]
    n = ssm_f.shape[-1]
    conv_dim = w["conv_weight"].shape[0]
    z, xbc, dt = proj.split([h * p, conv_dim, h], 1)
    if triton_kernels:
        from hybridkv.kernels.conv1d import conv1d_update_triton as conv
        from hybridkv.kernels.mamba2 import mamba2_state_update_triton as step
    else:
        conv, step = conv1d_ref.conv1d_update_ref, mamba2_ref.mamba2_state_update_ref
    x, B, C = conv(xbc, conv_f, w["conv_weight"], w["conv_bias"], slots, "silu").split([h * p, g * n, g * n], 1)
    y = step(ssm_f, x.reshape(-1, h, p), dt, -torch.exp(w["A_log"]), B.reshape(-1, g, n), C.reshape(-1, g, n),
             w["D"], None, w["dt_bias"], slots)
    return gated_norm(y.reshape(-1, h * p), z, w["norm_weight"], w["norm_group"], w["eps"], w["norm_mode"])


def _mixer_check(dtype, dev, gen, small, cache):
    from hybridkv.kernels.mamba2_quantized_triton import mamba2_mixer_decode_q_triton

    cl, sl, conv_q, ssm_q, slots, w, proj = mixer_case(dev, gen, cache, *((3, 4, 16, 16, 1) if small
                                                                            else (256, 64, 64, 128, 1)))
    conv_f, ssm_f = cl.decode(conv_q), sl.decode(ssm_q)
    want = _float_mixer(proj, slots, conv_f, ssm_f, w, triton_kernels=False)
    want_conv, want_ssm = conv_q.clone(), ssm_q.clone()
    s = slots.long()
    want_conv[s], want_ssm[s] = cl.encode(conv_f[s]), sl.encode(ssm_f[s])
    got = mamba2_mixer_decode_q_triton(proj, slots, conv_pool=conv_q, conv_layout=cl, ssm_pool=ssm_q, ssm_layout=sl,
                                       cache={}, **w)
    beyond_one_step = ((_steps(ssm_q[:, :sl.numel], cache) - _steps(want_ssm[:, :sl.numel], cache)).abs() - 1)
    beyond_one_step = beyond_one_step.clamp_min(0).float()
    return [(got, want), (conv_q.float(), want_conv.float()),
            (beyond_one_step + 1, torch.ones_like(beyond_one_step))]  # rel err: the most steps beyond one


def _steps(codes: torch.Tensor, cache: str) -> torch.Tensor:
    """Codes as integers in the order of their values (fp8: sign and magnitude, -0 = +0)."""
    if cache == "int8":
        return codes.view(torch.int8).int()
    c = codes.int()
    return torch.where(c >= 128, -(c - 128), c)


CHECKS = {
    "quantized_decode_attn_int8": lambda dt, dev, g, small: _attention_check(dt, dev, g, small, "int8"),
    "quantized_decode_attn_fp8": lambda dt, dev, g, small: _attention_check(dt, dev, g, small, "fp8_e4m3"),
    "mamba2_mixer_decode_q_int8": lambda dt, dev, g, small: _mixer_check(dt, dev, g, small, "int8"),
    "mamba2_mixer_decode_q_fp8": lambda dt, dev, g, small: _mixer_check(dt, dev, g, small, "fp8_e4m3"),
}


def timing_rows(dev, ms_of, dry, copy_bw):
    """Each quantized kernel against the float kernels it replaces (see the module docstring)."""
    from hybridkv.kernels.attention_decode_quantized_triton import quantized_decode_attention_triton
    from hybridkv.kernels.mamba2_quantized_triton import mamba2_mixer_decode_q_triton
    from hybridkv.kernels.paged_attention_kernel import paged_attention_triton

    gen = torch.Generator(device=dev).manual_seed(4)
    rows = []
    b, ctx, hkv, hq, d, bs = (2, 40, 2, 4, 16, 16) if dry else (64, 4096, 8, 32, 128, 16)
    qsl = torch.arange(b + 1, dtype=torch.int32, device=dev)
    for cache in ("int8", "fp8_e4m3"):
        layout, pool, fresh, slots, q, table, lens = kv_case(dev, gen, cache, [ctx] * b, bs, hkv, hq, d)
        ms = ms_of(lambda: quantized_decode_attention_triton(q, fresh, pool, layout, slots, table, lens, d ** -0.5,
                                                             None, None, None, {}))
        nbytes = b * ctx * hkv * 2 * layout.nbytes
        rows.append({"case": f"quantized decode attn {cache} [B{b} x {ctx}]", "ms": ms,
                     "GB/s": nbytes / (ms * 1e-3) / 1e9, "of_copy_bw": nbytes / (ms * 1e-3) / copy_bw,
                     "shape": f"Hq{hq} Hkv{hkv} D{d} bs{bs}"})
    pages = layout.decode(pool)
    for dtype in (torch.float32, torch.bfloat16):
        kv, qd = pages.to(dtype), q.to(dtype)
        ms = ms_of(lambda: paged_attention_triton(qd, kv, qsl, lens, table, d ** -0.5, max_query_len=1,
                                                  max_seq_len=ctx))
        nbytes = b * ctx * hkv * 2 * d * kv.element_size()
        rows.append({"case": f"float decode attn {str(dtype)[6:]} [B{b} x {ctx}]", "ms": ms,
                     "GB/s": nbytes / (ms * 1e-3) / 1e9, "of_copy_bw": nbytes / (ms * 1e-3) / copy_bw,
                     "shape": f"Hq{hq} Hkv{hkv} D{d} bs{bs}"})
    sizes = (3, 4, 16, 16, 1) if dry else (256, 64, 64, 128, 1)
    for cache in ("int8", "fp8_e4m3"):
        cl, sl, conv_q, ssm_q, slots, w, proj = mixer_case(dev, gen, cache, *sizes)
        ms = ms_of(lambda: mamba2_mixer_decode_q_triton(proj, slots, conv_pool=conv_q, conv_layout=cl, ssm_pool=ssm_q,
                                                        ssm_layout=sl, cache={}, **w))
        nbytes = 2 * sizes[0] * (cl.nbytes + sl.nbytes)
        rows.append({"case": f"quantized mamba2 decode {cache} [B{sizes[0]}]", "ms": ms,
                     "GB/s": nbytes / (ms * 1e-3) / 1e9, "of_copy_bw": nbytes / (ms * 1e-3) / copy_bw,
                     "shape": f"H{sizes[1]} P{sizes[2]} N{sizes[3]}"})
    conv_f, ssm_f = cl.decode(conv_q), sl.decode(ssm_q)
    ms = ms_of(lambda: _float_mixer(proj, slots, conv_f, ssm_f, w, triton_kernels=True))
    nbytes = 2 * sizes[0] * 4 * (cl.numel + sl.numel)
    rows.append({"case": f"float mamba2 decode fp32 [B{sizes[0]}]", "ms": ms, "GB/s": nbytes / (ms * 1e-3) / 1e9,
                 "of_copy_bw": nbytes / (ms * 1e-3) / copy_bw, "shape": f"H{sizes[1]} P{sizes[2]} N{sizes[3]}"})
    return rows
