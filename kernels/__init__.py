"""hybridkv.kernels: paged attention and slot-indexed state kernels, each with a torch reference.

Every public function here dispatches (see dispatch.py) to a Triton kernel on CUDA and to its
torch reference on CPU; `HYBRIDKV_BACKEND=torch|triton` forces one. Shapes are documented on
the reference functions, which are the specification.

Packed/varlen convention: T tokens of R requests, request r owns rows
`query_start_loc[r]:query_start_loc[r+1]`. Recurrent kernels read and write pool tensors in place
through `slot_idx [R]` (int32); slot 0 is the null slot. `has_initial_state [R]` False means the
request starts from a zero state (the slot's old contents are ignored and overwritten).
"""
from __future__ import annotations

from .dispatch import backend_for


def _pick(t, ref, triton_name, module, plan_cache=None):
    if _backend(t, plan_cache) == "triton":
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{module}"), triton_name)
    return ref


def _backend(t, plan_cache=None) -> str:
    """backend_for(t), looked up once per step when the step's plan_cache (a dict) is given."""
    if plan_cache is None:
        return backend_for(t)
    backend = plan_cache.get("backend")
    if backend is None:
        backend = plan_cache["backend"] = backend_for(t)
    return backend


def paged_attention(q, kv_cache, query_start_loc, seq_lens, block_table, scale, causal=True,
                    sliding_window=None, soft_cap=None, max_query_len=None, max_seq_len=None,
                    plan_cache=None, sinks=None):
    """q [T, Hq, D], kv_cache [num_blocks, 2, bs, Hkv, D] -> out [T, Hq, D]; see attention_ref.
    plan_cache: a per-step dict (ForwardBatch.kernel_plans) the CPU path keeps its step plan in.
    sinks: [Hq] per-head sink logits in the softmax denominator (GPT-OSS), or None."""
    from .attention_cpu import paged_attention_cpu  # batched torch path; attention_ref is the spec

    fn = _pick(q, paged_attention_cpu, "paged_attention_triton", "paged_attention_kernel", plan_cache)
    kw = {"plan_cache": plan_cache} if fn is paged_attention_cpu else {}
    if sinks is not None:  # only then: kernels without the option keep their signature
        kw["sinks"] = sinks
    return fn(q, kv_cache, query_start_loc, seq_lens, block_table, scale, causal=causal,
              sliding_window=sliding_window, soft_cap=soft_cap, max_query_len=max_query_len,
              max_seq_len=max_seq_len, **kw)


def write_kv(k, v, kv_cache, slot_mapping, plan_cache=None):
    """k, v [T, Hkv, D] into kv_cache at flat slots `slot_mapping [T]` (-1 skipped)."""
    from .write_kv_cpu import write_kv_cpu  # one indexed write; attention_ref.write_kv_ref is the spec

    fn = _pick(k, write_kv_cpu, "write_kv_triton", "write_kv_kernel", plan_cache)
    return fn(k, v, kv_cache, slot_mapping, plan_cache) if fn is write_kv_cpu else \
        fn(k, v, kv_cache, slot_mapping)


def rope_write_kv(qkv, rope, num_heads, num_kv_heads, head_dim, kv_cache, slot_mapping, plan_cache=None):
    """qkv [T, (Hq + 2 Hkv) * D], rope (cos, sin) [T, rot] or None -> q [T, Hq, D] rotated, k
    (rotated) and v written into kv_cache at slot_mapping, as apply_rotary + write_kv; one C loop
    on CPU. None where no such kernel runs (other devices, dtypes, backends): the caller runs those two."""
    if _backend(qkv, plan_cache) != "torch":
        return None
    from .write_kv_cpu import rope_write_kv_cpu

    return rope_write_kv_cpu(qkv, rope, num_heads, num_kv_heads, head_dim, kv_cache, slot_mapping, plan_cache)


def causal_conv1d(x, conv_state, weight, bias, query_start_loc, slot_idx, has_initial_state,
                  activation="silu"):
    """Varlen prefill conv. x [T, dim], conv_state [S, dim, k-1], weight [dim, k] -> [T, dim]."""
    from .causal_conv_cpu import causal_conv1d_cpu  # packed torch path; conv1d_ref is the spec

    fn = _pick(x, causal_conv1d_cpu, "causal_conv1d_triton", "conv1d")
    x = x if fn is causal_conv1d_cpu else x.contiguous()  # the torch path takes strided columns
    return fn(x, conv_state, weight, bias, query_start_loc, slot_idx, has_initial_state, activation)


def conv1d_update(x, conv_state, weight, bias, slot_idx, activation="silu"):
    """Decode conv, one token per request. x [B, dim] -> [B, dim]; conv_state updated in place."""
    from .causal_conv_cpu import conv1d_update_cpu  # in-place torch path; conv1d_ref is the spec

    fn = _pick(x, conv1d_update_cpu, "conv1d_update_triton", "conv1d")
    return fn(x, conv_state, weight, bias, slot_idx, activation)


def mamba1_state_update(ssm_state, x, dt, A, B, C, D, z, dt_bias, slot_idx, dt_softplus=True):
    """Selective-scan step. ssm_state [S, d_inner, N]; x, dt, z [B, d_inner]; B, C [B, N]."""
    from .mamba1_cpu import mamba1_state_update_cpu  # in-place torch path; mamba1_ref is the spec

    fn = _pick(x, mamba1_state_update_cpu, "mamba1_state_update_triton", "mamba1")
    return fn(ssm_state, x, dt, A, B, C, D, z, dt_bias, slot_idx, dt_softplus)


def mamba1_scan(ssm_state, x, dt, A, B, C, D, z, dt_bias, query_start_loc, slot_idx,
                has_initial_state, dt_softplus=True, return_states_at=None):
    """Varlen selective scan from each slot's state; leaves the final state in the slot."""
    from .mamba1_ref import mamba1_scan_ref

    fn = _pick(x, mamba1_scan_ref, "mamba1_scan_triton", "mamba1_prefill")
    return fn(ssm_state, x, dt, A, B, C, D, z, dt_bias, query_start_loc, slot_idx,
              has_initial_state, dt_softplus, return_states_at)


def mamba2_state_update(ssm_state, x, dt, A, B, C, D, z, dt_bias, slot_idx, dt_softplus=True,
                        dt_limit=None):
    """SSD step. ssm_state [S, H, P, N]; x [B, H, P]; dt [B, H]; B, C [B, G, N] -> y [B, H, P]."""
    from .mamba2_cpu import mamba2_state_update_cpu  # in-place torch path; mamba2_ref is the spec

    fn = _pick(x, mamba2_state_update_cpu, "mamba2_state_update_triton", "mamba2")
    return fn(ssm_state, x, dt, A, B, C, D, z, dt_bias, slot_idx, dt_softplus, dt_limit=dt_limit)


def mamba2_chunk_scan(ssm_state, x, dt, A, B, C, D, z, dt_bias, query_start_loc, slot_idx,
                      has_initial_state, chunk_size=256, dt_softplus=True, return_states_at=None,
                      dt_limit=None):
    """Varlen chunked SSD from each slot's state; leaves the final state in the slot."""
    from .mamba2_cpu import mamba2_chunk_scan_cpu  # batched torch path; mamba2_ref is the spec

    fn = _pick(x, mamba2_chunk_scan_cpu, "mamba2_chunk_scan_triton", "ssd_prefill")
    return fn(ssm_state, x, dt, A, B, C, D, z, dt_bias, query_start_loc, slot_idx,
              has_initial_state, chunk_size, dt_softplus, return_states_at, dt_limit=dt_limit)


def gdn_state_update(state, q, k, v, g, beta, slot_idx, scale=None, use_qk_l2norm=True):
    """Gated delta rule step. state [S, HV, K, V]; q, k [B, H, K]; v [B, HV, V]; g, beta [B, HV]."""
    from .gdn_cpu import gdn_state_update_cpu  # in-place torch path; gdn_ref is the spec

    fn = _pick(q, gdn_state_update_cpu, "gdn_state_update_triton", "gdn")
    return fn(state, q, k, v, g, beta, slot_idx, scale, use_qk_l2norm)


def gdn_chunk_scan(state, q, k, v, g, beta, query_start_loc, slot_idx, has_initial_state,
                   scale=None, use_qk_l2norm=True, chunk_size=64, return_states_at=None):
    """Varlen chunked gated delta rule from each slot's state; leaves the final state in the slot."""
    from .gdn_cpu import gdn_chunk_scan_cpu  # packed-chunk torch path; gdn_ref is the spec

    fn = _pick(v, gdn_chunk_scan_cpu, "gdn_chunk_scan_triton", "gdn_prefill")
    return fn(state, q, k, v, g, beta, query_start_loc, slot_idx, has_initial_state, scale,
              use_qk_l2norm, chunk_size, return_states_at)


def lightning_state_update(state, q, k, v, slope, slot_idx):
    """Lightning-attention step. state [S, H, K, V]; q, k [B, H, K]; v [B, H, V]; slope [H]."""
    from .lightning_ref import lightning_state_update_ref

    fn = _pick(q, lightning_state_update_ref, "lightning_state_update_triton", "lightning")
    return fn(state, q, k, v, slope, slot_idx)


def lightning_chunk_scan(state, q, k, v, slope, query_start_loc, slot_idx, has_initial_state,
                         chunk_size=64, return_states_at=None):
    """Varlen chunked lightning attention from each slot's state; leaves the final state there."""
    from .lightning_ref import lightning_chunk_scan_ref

    fn = _pick(v, lightning_chunk_scan_ref, "lightning_chunk_scan_triton", "lightning_prefill")
    return fn(state, q, k, v, slope, query_start_loc, slot_idx, has_initial_state, chunk_size,
              return_states_at)


def fused_moe(hidden, w_gate_up, w_down, topk_weights, topk_ids, activation="silu", gated=True,
              gate_up_bias=None, down_bias=None, swiglu=None):
    """MoE experts. hidden [T, H], w_gate_up [E, 2I, H] (gated) or [E, I, H], w_down [E, H, I],
    topk_weights / topk_ids [T, k] -> [T, H]; see fused_moe_ref. Biases and swiglu=(alpha, limit)
    (GPT-OSS) run on the torch path on every device: the Triton kernel has neither yet."""
    from .fused_moe_cpu import fused_moe_torch  # grouped-matmul torch path; fused_moe_ref is the spec

    if gate_up_bias is not None or down_bias is not None or swiglu is not None:
        return fused_moe_torch(hidden, w_gate_up, w_down, topk_weights, topk_ids, activation, gated,
                               gate_up_bias, down_bias, swiglu)
    fn = _pick(hidden, fused_moe_torch, "fused_moe_triton", "fused_moe_kernel")
    return fn(hidden, w_gate_up, w_down, topk_weights, topk_ids, activation, gated)


def kda_state_update(state, q, k, v, g, beta, slot_idx, scale=None, use_qk_l2norm=True):
    """Kimi delta attention step. state [S, H, K, V]; q, k, g [B, H, K]; v [B, H, V]; beta [B, H]."""
    from .kda_ref import kda_state_update_ref

    fn = _pick(q, kda_state_update_ref, "kda_state_update_triton", "kda")
    return fn(state, q, k, v, g, beta, slot_idx, scale, use_qk_l2norm)


def kda_chunk_scan(state, q, k, v, g, beta, query_start_loc, slot_idx, has_initial_state,
                   scale=None, use_qk_l2norm=True, chunk_size=16, return_states_at=None):
    """Varlen chunked Kimi delta attention from each slot's state; leaves the final state there."""
    from .kda_ref import kda_chunk_scan_ref

    fn = _pick(v, kda_chunk_scan_ref, "kda_chunk_scan_triton", "kda_prefill")
    return fn(state, q, k, v, g, beta, query_start_loc, slot_idx, has_initial_state, scale,
              use_qk_l2norm, chunk_size, return_states_at)


def write_latent(latent, kv_cache, slot_mapping):
    """latent [T, D] into latent pages kv_cache [N, 1, bs, 1, D] at flat slots (-1 skipped)."""
    from .latent_attention_ref import write_latent_ref

    fn = _pick(latent, write_latent_ref, "write_latent_triton", "latent_write_kernel")
    return fn(latent, kv_cache, slot_mapping)


def latent_paged_attention(q, kv_cache, kv_b_weight, query_start_loc, seq_lens, block_table, scale,
                           nope_dim, v_dim, max_query_len=None):
    """MLA over latent pages: q [T, H, nope + rope] -> o [T, H, v_dim]; see latent_attention_ref.
    max_query_len=1 (a host fact: every request decodes one token) on the Triton backend runs
    latent_attention_decode, which has no host sync; everything else runs the reference."""
    from .latent_attention_ref import latent_paged_attention_ref

    if max_query_len == 1 and q.shape[0] == seq_lens.shape[0] and backend_for(q) == "triton":
        from .latent_attention_decode import latent_decode_attention

        return latent_decode_attention(q, kv_cache, kv_b_weight, seq_lens, block_table, scale,
                                       nope_dim, v_dim)
    return latent_paged_attention_ref(q, kv_cache, kv_b_weight, query_start_loc, seq_lens,
                                      block_table, scale, nope_dim, v_dim)
