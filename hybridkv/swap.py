"""Moving one request's KV and state between the pools and host (or another engine)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.block_pool import BlockPool
from hybridkv.state_pool import StatePool


@dataclass
class HostCopy:
    """A swapped-out request: kv[layer] `[n_blocks, 2, block_size, kv_heads, head_dim]`, one slot's state."""

    kv: dict[int, torch.Tensor]
    conv: dict[int, torch.Tensor]
    ssm: dict[int, torch.Tensor]
    num_blocks: int


def copy_out(blocks: BlockPool, states: StatePool, block_ids: list[int], slot: int,
             device: torch.device | str = "cpu") -> HostCopy:
    """Copy blocks and slot to `device` (pinned host memory when the pools are on CUDA)."""
    pin = _pin(blocks, states, device)
    kv = blocks.gather(block_ids, device, pin) if block_ids else {}
    conv, ssm = states.to_host(slot, device, pin) if slot else ({}, {})
    return HostCopy(kv, conv, ssm, len(block_ids))


def copy_in(blocks: BlockPool, states: StatePool, copy: HostCopy, block_ids: list[int], slot: int) -> None:
    """Write a HostCopy into freshly allocated `block_ids` and `slot`."""
    if block_ids:
        blocks.scatter(block_ids, copy.kv)
    if slot:
        states.from_host(slot, copy.conv, copy.ssm)


def kv_tokens(blocks: BlockPool, block_ids: list[int], num_tokens: int,
              device: torch.device | str = "cpu") -> dict[int, torch.Tensor]:
    """KV of tokens [0, num_tokens) per layer as `[2, num_tokens, kv_heads, head_dim]` on `device`."""
    if not block_ids:
        return {i: t.new_empty((2, 0, *t.shape[3:]), device=device) for i, t in blocks.kv.items()}
    out = {}
    for i, t in blocks.gather(block_ids, device).items():
        n, _, bs, h, d = t.shape
        out[i] = t.permute(1, 0, 2, 3, 4).reshape(2, n * bs, h, d)[:, :num_tokens].contiguous()
    return out


def blocks_from_tokens(kv: dict[int, torch.Tensor], block_size: int) -> dict[int, torch.Tensor]:
    """Inverse of kv_tokens for any block size: `[2, T, h, d]` -> `[ceil(T/bs), 2, bs, h, d]`, zero-padded."""
    out = {}
    for i, t in kv.items():
        _, T, h, d = t.shape
        n = -(-T // block_size)
        padded = t.new_zeros((2, n * block_size, h, d))
        padded[:, :T] = t
        out[i] = padded.reshape(2, n, block_size, h, d).permute(1, 0, 2, 3, 4).contiguous()
    return out


def _pin(blocks: BlockPool, states: StatePool, device) -> bool:
    on_cuda = any(t.is_cuda for t in list(blocks.kv.values()) + list(states.conv.values()) + list(states.ssm.values()))
    return on_cuda and torch.device(device).type == "cpu"
