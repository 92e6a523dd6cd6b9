"""KV in token-major form `[parts, T, kv_heads, head_dim]` and back to blocks: for swap and migration,
across managers of any block size (parts: 2 for key and value, 1 for a latent)."""
from __future__ import annotations

import torch

from hybridkv.block_pool import BlockPool


def kv_tokens(blocks: BlockPool, block_ids: list[int], num_tokens: int,
              device: torch.device | str = "cpu") -> dict[int, torch.Tensor]:
    """KV of tokens [0, num_tokens) per layer as `[parts, num_tokens, kv_heads, head_dim]` on `device`."""
    if not block_ids:
        return {i: t.new_empty((t.shape[1], 0, *t.shape[3:]), device=device) for i, t in blocks.kv.items()}
    out = {}
    for i, t in blocks.gather(block_ids, device).items():
        n, parts, bs, h, d = t.shape
        out[i] = t.permute(1, 0, 2, 3, 4).reshape(parts, n * bs, h, d)[:, :num_tokens].contiguous()
    return out


def blocks_from_tokens(kv: dict[int, torch.Tensor], block_size: int) -> dict[int, torch.Tensor]:
    """Inverse of kv_tokens for any block size: `[p, T, h, d]` -> `[ceil(T/bs), p, bs, h, d]`, zero-padded."""
    out = {}
    for i, t in kv.items():
        parts, T, h, d = t.shape
        n = -(-T // block_size)
        padded = t.new_zeros((parts, n * block_size, h, d))
        padded[:, :T] = t
        out[i] = padded.reshape(parts, n, block_size, h, d).permute(1, 0, 2, 3, 4).contiguous()
    return out
