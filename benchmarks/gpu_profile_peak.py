"""Peak torch allocation of one Mamba2 layer's chunked SSD (torch path) at 256 vs 2048 tokens.

Why: scheduler/profiler.py measured peak activations with a 256-token prefill, but a step of
max_num_batched_tokens (2048+) allocates far more SSD temporaries. Measured on CPU with
torch.profiler(profile_memory=True): allocations and frees in time order, running sum, max.
Shape: Bamba-9B's Mamba2 layer (128 heads x 64, 1 group, d_state 128, chunk 256), bf16.

    python benchmarks/gpu_profile_peak.py   # ~1 minute on one core
"""
import torch
from torch.profiler import ProfilerActivity, profile

from hybridkv.kernels.mamba2_cpu import mamba2_chunk_scan_cpu

H, P, N, G, CHUNK = 128, 64, 128, 1, 256


def peak_bytes(tokens: int) -> int:
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).bfloat16()  # noqa: E731
    state = torch.zeros(2, H, P, N, dtype=torch.bfloat16)
    args = (state, r(tokens, H, P), r(tokens, H), -torch.rand(H) - 0.5, r(tokens, G, N),
            r(tokens, G, N), torch.ones(H), None, torch.zeros(H),
            torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
            torch.tensor([False]))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        mamba2_chunk_scan_cpu(*args, CHUNK)
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage != 0),
                    key=lambda e: e.time_range.start)
    cur = peak = 0
    for e in events:
        cur += e.self_cpu_memory_usage
        peak = max(peak, cur)
    return peak


if __name__ == "__main__":
    torch.set_num_threads(1)
    for tokens in (256, 2048):
        print(f"{tokens} tokens: peak SSD temporaries {peak_bytes(tokens) / 2**20:.0f} MiB")
