"""hybridkv.kernels: paged attention, slot-indexed state kernels and the dense ops around them.

`ops.py` declares every op once, with its CPU implementation (torch, and the native C kernels of
native_cpu.py where they apply) and its CUDA one (a Triton kernel, or torch where there is none);
models call `ops.<name>(...)`. The backend follows the device of the op's first argument, and
`HYBRIDKV_BACKEND=torch|triton` forces one (dispatch.py). Shapes are documented on the ops and on
the torch references (`*_ref.py`), which are the specification. The ops of the attention and
recurrent layers are re-exported here under their names (`hybridkv.kernels.paged_attention`).

Packed/varlen convention: T tokens of R requests, request r owns rows
`query_start_loc[r]:query_start_loc[r+1]`. Recurrent kernels read and write pool tensors in place
through `slot_idx [R]` (int32); slot 0 is the null slot. `has_initial_state [R]` False means the
request starts from a zero state (the slot's old contents are ignored and overwritten).
"""
from __future__ import annotations

from .ops import (causal_conv1d, conv1d_update, fused_moe, gdn_chunk_scan, gdn_state_update, kda_chunk_scan,
                  kda_state_update, latent_paged_attention, lightning_chunk_scan, lightning_state_update,
                  mamba1_scan, mamba1_state_update, mamba2_chunk_scan, mamba2_state_update, paged_attention,
                  rope_write_kv, write_kv, write_latent)

__all__ = ["causal_conv1d", "conv1d_update", "fused_moe", "gdn_chunk_scan", "gdn_state_update", "kda_chunk_scan",
           "kda_state_update", "latent_paged_attention", "lightning_chunk_scan", "lightning_state_update",
           "mamba1_scan", "mamba1_state_update", "mamba2_chunk_scan", "mamba2_state_update", "paged_attention",
           "rope_write_kv", "write_kv", "write_latent"]
