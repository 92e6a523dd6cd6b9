"""The chunked prefill references of lightning attention and Kimi delta attention against
transformers' torch implementations of the same computation, CPU, one torch thread, one process.

    python benchmarks/bench_linear_attention_cpu.py              # 7 repeats
    python benchmarks/bench_linear_attention_cpu.py --repeats 5 --quick

Cases (fp32, one request from a zero state, the final state returned by both):
- KDA: ours `kda_chunk_scan_ref` (chunks of 16, a triangular solve per chunk) against
  transformers' `chunk_kimi_delta_attention` torch path (chunks of 64, a row-by-row inverse).
- lightning: ours `lightning_chunk_scan_ref` (chunks of 64) against the core of transformers'
  `MiniMaxLightningAttention.forward` (blocks of 64; its norm and out_proj set to identities and
  its output gate to 1/2, so it returns half the core). Its time INCLUDES the qkv_proj and
  output_gate matmuls its forward cannot skip, so that ratio overstates ours; the case is mainly
  the agreement check at a long prompt.
Each repeat runs both alternating on the same inputs; a repeat's time is CPU time
(`time.process_time`) per call. Printed: median and min-max of each, the ratio of the medians and
the agreement of the outputs and final states (relative max error).
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from transformers import MiniMaxConfig
from transformers.models.kimi_linear import modeling_kimi_linear as kl
from transformers.models.minimax import modeling_minimax as mm

from hybridkv.kernels.kda_ref import kda_chunk_scan_ref
from hybridkv.kernels.lightning_ref import lightning_chunk_scan_ref


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def cpu_time(fn, inner):
    t = time.process_time()
    for _ in range(inner):
        out = fn()
    return (time.process_time() - t) / inner, out


def kda_case(L, H, K):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(L, H, K, generator=gen) for _ in range(3))
    g = -F.softplus(torch.randn(L, H, K, generator=gen) - 1.0)
    beta = torch.rand(L, H, generator=gen)
    qsl, slot, init = torch.tensor([0, L], dtype=torch.int32), torch.tensor([1], dtype=torch.int32), torch.tensor([False])
    hf = getattr(kl.chunk_kimi_delta_attention, "__wrapped__", kl.chunk_kimi_delta_attention)

    def ours():
        pool = torch.zeros(2, H, K, K)
        return kda_chunk_scan_ref(pool, q, k, v, g, beta, qsl, slot, init, chunk_size=16), pool[1]

    def theirs():
        o, s = hf(q[None], k[None], v[None], g=g[None], beta=beta[None], chunk_size=64,
                  initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True)
        return o[0], s[0]

    return ours, theirs


def lightning_case(L, H, K):
    gen = torch.Generator().manual_seed(1)
    cfg = MiniMaxConfig(hidden_size=H * K, num_attention_heads=H, head_dim=K, num_hidden_layers=4,
                        block_size=64, layer_types=["linear_attention"] * 4)
    m = mm.MiniMaxLightningAttention(cfg, 1).eval()
    with torch.no_grad():
        m.qkv_proj.weight.copy_(torch.randn(m.qkv_proj.weight.shape, generator=gen) * 0.1)
        m.output_gate.weight.zero_()
    m.norm, m.out_proj = nn.Identity(), nn.Identity()
    hidden = torch.randn(1, L, H * K, generator=gen)
    with torch.no_grad():
        q, k, v = torch.split(F.silu(m.qkv_proj(hidden[0])).view(L, H, 3 * K), K, dim=-1)
    slope = m.slope_rate.view(H).clone()
    qsl, slot, init = torch.tensor([0, L], dtype=torch.int32), torch.tensor([1], dtype=torch.int32), torch.tensor([False])

    def ours():
        pool = torch.zeros(2, H, K, K)
        return lightning_chunk_scan_ref(pool, q, k, v, slope, qsl, slot, init, 64), pool[1]

    @torch.no_grad()
    def theirs():  # the projections are part of its forward; qkv_proj is one matmul of L x H*K
        out, state = m(hidden, None, None)
        return 2 * out[0].view(L, H, K), state[0]

    return ours, theirs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="smaller shapes, fewer inner calls")
    args = ap.parse_args()
    torch.set_num_threads(1)
    L, H, K, inner = (256, 4, 32, 2) if args.quick else (1024, 8, 64, 3)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread; "
          f"L={L} H={H} K=V={K}, fp32, {args.repeats} repeats x {inner} calls")
    for name, case in (("KDA chunked prefill", kda_case),
                       ("lightning chunked prefill (theirs with 2 projections)", lightning_case)):
        ours, theirs = case(L, H, K)
        t_ours, t_theirs = [], []
        for _ in range(args.repeats):
            a, (o1, s1) = cpu_time(ours, inner)
            b, (o2, s2) = cpu_time(theirs, inner)
            t_ours.append(a)
            t_theirs.append(b)
        mo, mt = statistics.median(t_ours), statistics.median(t_theirs)
        print(f"{name}: ours {mo * 1e3:.1f} ms ({min(t_ours) * 1e3:.1f}-{max(t_ours) * 1e3:.1f}), "
              f"transformers {mt * 1e3:.1f} ms ({min(t_theirs) * 1e3:.1f}-{max(t_theirs) * 1e3:.1f}), "
              f"transformers / ours {mt / mo:.2f}x; rel err out {rel(o1, o2):.1e} state {rel(s1, s2):.1e}")


if __name__ == "__main__":
    main()
