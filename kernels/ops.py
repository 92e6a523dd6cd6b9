"""Every kernel op, declared once: its signature, its CPU implementation and its CUDA one. Models call
these (`from hybridkv.kernels import ops; ops.mamba2_state_update(...)`), never a backend module.

CPU: torch, with the native C kernels where they apply (native_cpu.py; the torch code is their
fallback). CUDA: the Triton kernel (interpreted on the CPU under TRITON_INTERPRET=1), or torch
where there is none. The backend follows the device of the op's first argument;
`HYBRIDKV_BACKEND=torch|triton` forces one (dispatch.py); an op given a `plan_cache` (a per-step
dict, ForwardBatch.kernel_plans) looks the backend up once per step. An op with no kernel for a
backend (None below) returns None there, and its caller runs the unfused steps.

A registry of our own, not torch.library custom ops: measured on an RMSNorm row in C (~10 us a
call on the shared test machine), `torch.library.custom_op` adds ~30 us of dispatch per call,
`Library.impl` ~5 us, this registry ~0.5 us (docs/design.md, "Kernel ops";
benchmarks/bench_op_registry.py). An op's call takes the op's own parameters and hands them on
unchanged (dispatch.py). Implementations are named "module:function" of hybridkv.kernels, take
exactly the op's parameters (tests/kernels/test_ops.py) and are looked up at each call (a module
imports at first use, so Triton loads only where it runs; a test may patch one). The shapes are on
each op's docstring and on the torch references, which are the specification.
"""
from __future__ import annotations

from .dispatch import Op, declare

# --- attention --------------------------------------------------------------------------------
paged_attention = declare(
    "paged_attention(q, kv_cache, query_start_loc, seq_lens, block_table, scale, causal=True, sliding_window=None,"
    " soft_cap=None, max_query_len=None, max_seq_len=None, plan_cache=None, sinks=None)",
    "attention_cpu:paged_attention_cpu", "ops:_paged_attention_triton", """
q [T, Hq, D], kv_cache [num_blocks, 2, bs, Hkv, D] -> out [T, Hq, D]; see attention_ref. sinks [Hq]:
per-head sink logits in the softmax denominator (GPT-OSS).""")
write_kv = declare("write_kv(k, v, kv_cache, slot_mapping, plan_cache=None)",
                   "write_kv_cpu:write_kv_cpu", "ops:_write_kv_triton", """
k, v [T, Hkv, D] into kv_cache at flat slots slot_mapping [T] (-1 skipped).""")
rope_write_kv = declare(
    "rope_write_kv(qkv, rope, num_heads, num_kv_heads, head_dim, kv_cache, slot_mapping, plan_cache=None)",
    "write_kv_cpu:rope_write_kv_cpu", None, """
qkv [T, (Hq + 2 Hkv) * D], rope (cos, sin) [T, rot] or None -> q [T, Hq, D] rotated, k (rotated) and
v written into kv_cache at slot_mapping, as apply_rotary + write_kv in one C loop; None where it
does not run (the caller runs those two).""")
write_latent = declare("write_latent(latent, kv_cache, slot_mapping)",
                       "latent_attention_ref:write_latent_ref", "latent_write_kernel:write_latent_triton", """
latent [T, D] into latent pages kv_cache [N, 1, bs, 1, D] at flat slots (-1 skipped).""")
latent_paged_attention = declare(
    "latent_paged_attention(q, kv_cache, kv_b_weight, query_start_loc, seq_lens, block_table, scale, nope_dim,"
    " v_dim, max_query_len=None)",
    "ops:_latent_attention_ref", "ops:_latent_attention_triton", """
MLA over latent pages, q [T, H, nope + rope] -> o [T, H, v_dim]. On CUDA a decode step
(max_query_len=1, a host fact) runs latent_attention_decode (no host sync); everything else runs
the reference.""")
pooled_index_select = declare(
    "pooled_index_select(q, weights, index_cache, ape, query_start_loc, seq_lens, block_table, kpool, topk,"
    " scale, select_tail=True, max_query_len=None)",
    "sparse_index_ref:pooled_index_select", "sparse_index_ref:pooled_index_select", """
A DSA indexer over its own pages (key | k-pool gate per token) -> selected [T, table width x bs]
bool, the keys each query sees (torch on every device; decode steps, max_query_len=1, without a host
sync; see sparse_index_ref).""")
latent_sparse_attention = declare(
    "latent_sparse_attention(q, kv_cache, kv_b_weight, query_start_loc, seq_lens, block_table, scale, nope_dim,"
    " v_dim, selected, max_query_len=None)",
    "sparse_index_ref:latent_sparse_attention", "sparse_index_ref:latent_sparse_attention", """
Rotary-free MLA over latent pages where query t sees the keys `selected[t]` marks -> o [T, H, v_dim]
(torch on every device; decode steps without a host sync).""")
block_mean_index_select = declare(
    "block_mean_index_select(q, index_cache, query_start_loc, seq_lens, block_table, ratio, budget, key_fn,"
    " max_query_len=None)",
    "qsa_ref:block_mean_index_select", "qsa_ref:block_mean_index_select", """
Qwen4-Exp's QSA indexer over its latent pages of raw keys -> selected [T, table width x bs] bool
(torch; decode steps without a host sync; see qsa_ref).""")
paged_sparse_attention = declare(
    "paged_sparse_attention(q, kv_cache, query_start_loc, seq_lens, block_table, scale, selected,"
    " max_query_len=None)",
    "qsa_ref:paged_sparse_attention", "qsa_ref:paged_sparse_attention", """
GQA attention over paged KV where query t sees the keys `selected[t]` marks -> o [T, Hq, D] (torch
on every device; decode steps without a host sync).""")

# --- convolution and recurrent layers ----------------------------------------------------------
causal_conv1d = declare(
    "causal_conv1d(x, conv_state, weight, bias, query_start_loc, slot_idx, has_initial_state, activation='silu')",
    "causal_conv_cpu:causal_conv1d_cpu", "ops:_causal_conv1d_triton", """
Varlen prefill conv, x [T, dim], conv_state [S, dim, k-1], weight [dim, k] -> [T, dim].""")
conv1d_update = declare("conv1d_update(x, conv_state, weight, bias, slot_idx, activation='silu')",
                        "causal_conv_cpu:conv1d_update_cpu", "conv1d:conv1d_update_triton", """
Decode conv, one token per request, x [B, dim] -> [B, dim]; conv_state updated in place.""")
mamba1_state_update = declare(
    "mamba1_state_update(ssm_state, x, dt, A, B, C, D, z, dt_bias, slot_idx, dt_softplus=True)",
    "mamba1_cpu:mamba1_state_update_cpu", "mamba1:mamba1_state_update_triton", """
Selective-scan step, ssm_state [S, d_inner, N]; x, dt, z [B, d_inner]; B, C [B, N] -> y [B, d_inner].""")
mamba1_scan = declare(
    "mamba1_scan(ssm_state, x, dt, A, B, C, D, z, dt_bias, query_start_loc, slot_idx, has_initial_state,"
    " dt_softplus=True, return_states_at=None)",
    "mamba1_ref:mamba1_scan_ref", "mamba1_prefill:mamba1_scan_triton", """
Varlen selective scan from each slot's state; leaves the final state in the slot.""")
mamba2_state_update = declare(
    "mamba2_state_update(ssm_state, x, dt, A, B, C, D, z, dt_bias, slot_idx, dt_softplus=True, dt_limit=None)",
    "mamba2_cpu:mamba2_state_update_cpu", "mamba2:mamba2_state_update_triton", """
SSD step, ssm_state [S, H, P, N]; x [B, H, P]; dt [B, H]; B, C [B, G, N] -> y [B, H, P].""")
mamba2_chunk_scan = declare(
    "mamba2_chunk_scan(ssm_state, x, dt, A, B, C, D, z, dt_bias, query_start_loc, slot_idx, has_initial_state,"
    " chunk_size=256, dt_softplus=True, return_states_at=None, dt_limit=None)",
    "mamba2_cpu:mamba2_chunk_scan_cpu", "ssd_prefill:mamba2_chunk_scan_triton", """
Varlen chunked SSD from each slot's state; leaves the final state in the slot.""")
mamba2_mixer_decode = declare(
    "mamba2_mixer_decode(proj, slot_idx, *, conv_state, ssm_state, num_heads, head_dim, n_groups, conv_weight,"
    " conv_bias, A_log, dt_bias, D, norm_weight, norm_group, eps, norm_mode, cache, plan_cache=None)",
    "mamba2_native:mamba2_mixer_decode", None, """
A Mamba2 layer's whole decode between in_proj and out_proj in one C call (see
mamba2_native.mamba2_mixer_decode) -> y [B, H P], or None (the caller runs conv1d_update,
mamba2_state_update and its norm).""")
quantized_decode_attention = declare(
    "quantized_decode_attention(q, fresh, pool, layout, slot_mapping, block_table, seq_lens, scale, soft_cap,"
    " sliding_window, sinks, plan_cache)",
    "attention_decode_quantized:quantized_decode_attention",
    "attention_decode_quantized_triton:quantized_decode_attention_triton", """
A step of one-token decodes over a quantized KV pool (uint8 codes and scales, hybridkv.cache_dtype): the
new K/V fresh [R, 2, 1, Hkv, D] encoded into the pool, then attended with the pool's codes and the new
token at full precision -> out [R, Hq, D] fp32, or None (nothing written; the caller decodes the pages).""")
mamba2_mixer_decode_q = declare(
    "mamba2_mixer_decode_q(proj, slot_idx, *, conv_pool, conv_layout, ssm_pool, ssm_layout, num_heads, head_dim,"
    " n_groups, conv_weight, conv_bias, A_log, dt_bias, D, norm_weight, norm_group, eps, norm_mode, cache)",
    "mamba2_native:mamba2_mixer_decode_q", "mamba2_quantized_triton:mamba2_mixer_decode_q_triton", """
mamba2_mixer_decode over quantized state pools (uint8 codes and scales, hybridkv.cache_dtype), each slot
decoded, updated and encoded back in place (one C pass on CPU; on CUDA a conv and an SSD-step Triton
kernel, then the norm) -> y [B, H P], or None (nothing written; the caller runs the float path on
decoded slots).""")
gdn_decode_q = declare(
    "gdn_decode_q(mixed, g, beta, slot_idx, *, conv_pool, conv_layout, state_pool, state_layout, conv_weight,"
    " num_k_heads, head_k_dim, num_v_heads, head_v_dim)",
    "gdn_quantized:gdn_decode_q", None, """
A GDN layer's decode from the conv's input rows mixed [B, conv_dim] (and g, beta [B, HV]) to the core
output over quantized pools (uint8 codes and scales, hybridkv.cache_dtype): conv windows and states
decoded, stepped and encoded back in place in C -> o [B, HV, dv], or None (nothing written; the caller
runs the float path on decoded slots).""")
gdn_state_update = declare(
    "gdn_state_update(state, q, k, v, g, beta, slot_idx, scale=None, use_qk_l2norm=True)",
    "gdn_cpu:gdn_state_update_cpu", "gdn:gdn_state_update_triton", """
Gated delta rule step, state [S, HV, K, V]; q, k [B, H, K]; v [B, HV, V]; g, beta [B, HV] -> o [B, HV, V].""")
gdn_chunk_scan = declare(
    "gdn_chunk_scan(state, q, k, v, g, beta, query_start_loc, slot_idx, has_initial_state, scale=None,"
    " use_qk_l2norm=True, chunk_size=64, return_states_at=None)",
    "gdn_cpu:gdn_chunk_scan_cpu", "gdn_prefill:gdn_chunk_scan_triton", """
Varlen chunked gated delta rule.""")
kda_state_update = declare(
    "kda_state_update(state, q, k, v, g, beta, slot_idx, scale=None, use_qk_l2norm=True)",
    "kda_ref:kda_state_update_ref", "kda:kda_state_update_triton", """
Kimi delta attention step, state [S, H, K, V]; q, k, g [B, H, K]; v [B, H, V]; beta [B, H].""")
kda_chunk_scan = declare(
    "kda_chunk_scan(state, q, k, v, g, beta, query_start_loc, slot_idx, has_initial_state, scale=None,"
    " use_qk_l2norm=True, chunk_size=16, return_states_at=None)",
    "kda_ref:kda_chunk_scan_ref", "kda_prefill:kda_chunk_scan_triton", """
Varlen chunked Kimi delta attention.""")
lightning_state_update = declare("lightning_state_update(state, q, k, v, slope, slot_idx)",
                                 "lightning_ref:lightning_state_update_ref",
                                 "lightning:lightning_state_update_triton", """
Lightning-attention step, state [S, H, K, V]; q, k [B, H, K]; v [B, H, V]; slope [H].""")
lightning_chunk_scan = declare(
    "lightning_chunk_scan(state, q, k, v, slope, query_start_loc, slot_idx, has_initial_state, chunk_size=64,"
    " return_states_at=None)",
    "lightning_ref:lightning_chunk_scan_ref", "lightning_prefill:lightning_chunk_scan_triton", """
Varlen chunked lightning attention.""")
rg_lru_state_update = declare(
    "rg_lru_state_update(state, x, input_gate, recurrent_gate, recurrent_param, slot_idx)",
    "rg_lru_ref:rg_lru_state_update_ref", "rg_lru_kernel:rg_lru_state_update_triton", """
One RG-LRU decode token per request; state [S, W] updated in place at slot_idx [B] -> y [B, W].""")
rg_lru_scan = declare(
    "rg_lru_scan(state, x, input_gate, recurrent_gate, recurrent_param, query_start_loc, slot_idx,"
    " has_initial_state, return_states_at=None)",
    "rg_lru_ref:rg_lru_scan_ref", "rg_lru_ref:rg_lru_scan_ref", """
Varlen RG-LRU scan (torch on every device).""")
rwkv4_state_update = declare(
    "rwkv4_state_update(state, key, value, time_decay, time_first, slot_idx)",
    "rwkv4_ref:rwkv4_state_update_ref", "rwkv4_ref:rwkv4_state_update_ref", """
One RWKV-4 WKV decode token per request; state [S, 3, C] float32 (num, den, max) updated in place at
slot_idx [B]; key, value [B, C] -> wkv [B, C] (torch on every device).""")
rwkv4_scan = declare(
    "rwkv4_scan(state, key, value, time_decay, time_first, query_start_loc, slot_idx, has_initial_state)",
    "rwkv4_ref:rwkv4_scan_ref", "rwkv4_ref:rwkv4_scan_ref", """
Varlen RWKV-4 WKV recurrence, key, value [T, C] -> wkv [T, C] (torch on every device).""")

# --- dense ------------------------------------------------------------------------------------
fused_moe = declare(
    "fused_moe(hidden, w_gate_up, w_down, topk_weights, topk_ids, activation='silu', gated=True,"
    " gate_up_bias=None, down_bias=None, swiglu=None, glu=None)",
    "fused_moe_cpu:fused_moe_torch", "ops:_fused_moe_triton", """
hidden [T, H], w_gate_up [E, 2I, H] (gated) or [E, I, H], w_down [E, H, I], topk [T, k] -> [T, H].
Biases and swiglu (GPT-OSS) and glu (a callable (gate, up) -> inner, Inkling 2) run the torch path
on every device: the Triton kernel has none yet.""")
rms_norm = declare("rms_norm(x, weight, eps, plus_one=False)", "rms_norm:rms_norm", "rms_norm:rms_norm", """
x [..., d], weight [d], float32 -> x / rms(x) * w (w = 1 + weight when plus_one); a C row loop on
CPU, torch elsewhere.""")
add_rms_norm = declare("add_rms_norm(h, delta, weight, eps, plus_one=False)",
                       "rms_norm:add_rms_norm", "rms_norm:add_rms_norm", """
h, delta [T, d] float32 -> (h + delta, its rms_norm); one pass on CPU.""")
gated_rms_norm = declare("gated_rms_norm(y, z, weight, eps, group_size, norm_before_gate)",
                         "rms_norm:gated_rms_norm", "rms_norm:gated_rms_norm", """
y, z [..., d] float32 -> the gated group norm in C on CPU, or None (other devices, prefill-sized
inputs: the caller runs the torch formula, GatedRMSNorm).""")

OPS = {op.name: op for op in globals().values() if isinstance(op, Op)}


# --- where a backend's function differs from the op's signature -------------------------------
def _paged_attention_triton(q, kv_cache, query_start_loc, seq_lens, block_table, scale, causal=True,
                            sliding_window=None, soft_cap=None, max_query_len=None, max_seq_len=None,
                            plan_cache=None, sinks=None):
    from .paged_attention_kernel import paged_attention_triton

    kw = {} if sinks is None else {"sinks": sinks}  # the kernel's sink-free signature otherwise
    return paged_attention_triton(q, kv_cache, query_start_loc, seq_lens, block_table, scale, causal=causal,
                                  sliding_window=sliding_window, soft_cap=soft_cap, max_query_len=max_query_len,
                                  max_seq_len=max_seq_len, **kw)


def _write_kv_triton(k, v, kv_cache, slot_mapping, plan_cache=None):
    from .write_kv_kernel import write_kv_triton

    return write_kv_triton(k, v, kv_cache, slot_mapping)


def _causal_conv1d_triton(x, conv_state, weight, bias, query_start_loc, slot_idx, has_initial_state,
                          activation="silu"):
    from .conv1d import causal_conv1d_triton

    return causal_conv1d_triton(x.contiguous(), conv_state, weight, bias, query_start_loc, slot_idx,
                                has_initial_state, activation)


def _latent_attention_ref(q, kv_cache, kv_b_weight, query_start_loc, seq_lens, block_table, scale, nope_dim,
                          v_dim, max_query_len=None):
    from .latent_attention_ref import latent_paged_attention_ref

    return latent_paged_attention_ref(q, kv_cache, kv_b_weight, query_start_loc, seq_lens, block_table, scale,
                                      nope_dim, v_dim)


def _latent_attention_triton(q, kv_cache, kv_b_weight, query_start_loc, seq_lens, block_table, scale,
                             nope_dim, v_dim, max_query_len=None):
    if max_query_len == 1 and q.shape[0] == seq_lens.shape[0]:
        from .latent_attention_decode import latent_decode_attention

        return latent_decode_attention(q, kv_cache, kv_b_weight, seq_lens, block_table, scale, nope_dim, v_dim)
    return _latent_attention_ref(q, kv_cache, kv_b_weight, query_start_loc, seq_lens, block_table, scale,
                                 nope_dim, v_dim)


def _fused_moe_triton(hidden, w_gate_up, w_down, topk_weights, topk_ids, activation="silu", gated=True,
                      gate_up_bias=None, down_bias=None, swiglu=None, glu=None):
    if gate_up_bias is not None or down_bias is not None or swiglu is not None or glu is not None:
        from .fused_moe_cpu import fused_moe_torch

        return fused_moe_torch(hidden, w_gate_up, w_down, topk_weights, topk_ids, activation, gated,
                               gate_up_bias, down_bias, swiglu, glu)
    from .fused_moe_kernel import fused_moe_triton

    return fused_moe_triton(hidden, w_gate_up, w_down, topk_weights, topk_ids, activation, gated)
