"""Shared helpers of the recurrent-state kernel tests (conv1d, Mamba1, Mamba2, GDN)."""
from __future__ import annotations

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b|, in fp32; b must not be all zeros (the tests never use zeros)."""
    a, b = a.float(), b.float()
    denom = b.abs().max().item()
    assert denom > 0, "reference is all zeros: the comparison would prove nothing"
    return (a - b).abs().max().item() / denom


def qsl(lengths: list[int]) -> torch.Tensor:
    """query_start_loc [R+1] int32 for requests of these token counts."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def shuffled_slots(n: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    """n distinct non-null slots (1..num_slots-1) in random order, int32."""
    return (torch.randperm(num_slots - 1, generator=gen)[:n] + 1).to(torch.int32)


def pieces(total: int, sizes=(5, 16, 7, 1, 3, 11)) -> list[tuple[int, int]]:
    """Cut [0, total) into uneven consecutive pieces, cycling through `sizes`."""
    out, start, i = [], 0, 0
    while start < total:
        end = min(total, start + sizes[i % len(sizes)])
        out.append((start, end))
        start, i = end, i + 1
    return out


def untouched(before: torch.Tensor, after: torch.Tensor, used: torch.Tensor) -> bool:
    """True when every slot not in `used` is bit-identical between the two pool tensors."""
    keep = torch.ones(before.shape[0], dtype=torch.bool)
    keep[used.long()] = False
    return torch.equal(before[keep], after[keep])


def torch_path(fn):
    """The torch implementation behind a transformers kernel-dispatch wrapper (never a hub kernel)."""
    return getattr(fn, "__wrapped__", fn)
