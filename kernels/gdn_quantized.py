"""The gated delta rule's decode over quantized state pools, read and written in place (CPU, C).

Why: under `state_cache_dtype` int8 / fp8_e4m3 a pool slot is codes and scales
(hybridkv/cache_dtype.py). Without this op a step of decodes decodes each slot's conv window and state
to float, runs the float decode and encodes them back (scheduler/cache_staging.py), passes over whole
working tensors; here the C kernels decode a slot's window, or a head of its state, into scratch as
they first read it and encode it back once stepped (kernels/native/mamba2_decode.c `conv1d_update_q`,
gdn_decode.c `gdn_state_update_q`).

What it computes is what the float decode computes on the decoded slots, value for value, and the
bytes of encoding its result: the conv is the float conv's own row function (conv_row), q and k are
prepared by the same torch code (gdn_ref.prepare_qk), and the state update is the float kernel's code
per row and column (no sum across a row, so no order can differ). The null slot 0 is read, never
written back (the staging writes back only real slots). Checked against a torch reference of that
arithmetic in tests/kernels/test_gdn_quantized.py.
"""
from __future__ import annotations

from . import native_cpu, quantize
from .gdn_ref import prepare_qk
from .mamba2_native import CONV1D_UPDATE_Q
from .native_args import as_rows, fp32_cpu, slots_int32
from .recurrent_native import GDN_STATE_UPDATE_Q


def gdn_decode_q(mixed, g, beta, slot_idx, *, conv_pool, conv_layout, state_pool, state_layout, conv_weight,
                 num_k_heads, head_k_dim, num_v_heads, head_v_dim):
    """ops.gdn_decode_q on CPU: one decode token per request of a GDN layer, from the conv's input to
    the core output, over quantized pools updated in place.

    mixed [B, 2 Hk dk + HV dv] fp32 (the conv's input rows [q | k | v], before the conv); g, beta
    [B, HV] fp32 (log-decay and beta as the mixer computes them); slot_idx [B]; conv_pool [S, conv
    nbytes] and state_pool [S, state nbytes] uint8 with their QuantLayouts of shapes [conv_dim, k-1]
    and [HV, dk, dv]; conv_weight [conv_dim, k] or nn.Conv1d's [conv_dim, 1, k] (no bias; silu).
    -> o [B, HV, dv] fp32, or None when it cannot run here (nothing written: the caller runs the float
    decode on decoded slots)."""
    if not native_cpu.enabled() or not (CONV1D_UPDATE_Q.available() and GDN_STATE_UPDATE_Q.available()):
        return None
    Hk, dk, HV, dv = num_k_heads, head_k_dim, num_v_heads, head_v_dim
    key_dim, value_dim = Hk * dk, HV * dv
    conv_dim = 2 * key_dim + value_dim
    weight = conv_weight.squeeze(1) if conv_weight.dim() == 3 else conv_weight
    k = weight.shape[-1]
    if not (fp32_cpu(mixed, g, beta, weight) and mixed.dim() == 2 and mixed.shape[1] == conv_dim
            and weight.is_contiguous() and tuple(weight.shape) == (conv_dim, k) and HV % Hk == 0
            and tuple(g.shape) == (mixed.shape[0], HV) and tuple(beta.shape) == (mixed.shape[0], HV)
            and quantize.is_quantized_pool(conv_pool, conv_layout, (conv_dim, k - 1))
            and quantize.is_quantized_pool(state_pool, state_layout, (HV, dk, dv))
            and conv_pool.shape[0] == state_pool.shape[0]):
        return None
    nb, num_slots = mixed.shape[0], conv_pool.shape[0]
    slots = slots_int32(slot_idx)
    x = as_rows(mixed, (conv_dim,))
    A, L, B = quantize.layout_dims(conv_layout)
    rc, y, _ = CONV1D_UPDATE_Q.call(
        pool=conv_pool, num_slots=num_slots, slots=slots, nb=nb, dim=conv_dim, k=k, nbytes=conv_layout.nbytes,
        code_bytes=conv_layout.code_bytes, A=A, L=L, B=B, fp8_values=_fp8_values(conv_layout), x=x,
        x_row=x.stride(0), weight=weight, bias=None, act=1)
    if rc:  # slots repeated or out of range: refused before anything was written
        return None
    q, kk, v = y.split([key_dim, key_dim, value_dim], dim=-1)
    qf, kf = prepare_qk(q.reshape(nb, Hk, dk), kk.reshape(nb, Hk, dk), HV, None, True)  # as gdn_state_update_cpu
    v, g, beta = as_rows(v.reshape(nb, HV, dv), (HV, dv)), as_rows(g, (HV,)), as_rows(beta, (HV,))
    rc, o, _ = GDN_STATE_UPDATE_Q.call(
        pool=state_pool, num_slots=num_slots, slots=slots, nb=nb, HV=HV, K=dk, V=dv, nbytes=state_layout.nbytes,
        code_bytes=state_layout.code_bytes, fp8_values=_fp8_values(state_layout), q=qf.contiguous(),
        k=kf.contiguous(), v=v, v_row=v.stride(0), g=g, g_row=g.stride(0), beta=beta, beta_row=beta.stride(0))
    if rc:  # the conv's check passed on the same slots and pool size: this cannot refuse them
        raise RuntimeError(f"gdn_state_update_q refused slots the conv accepted (rc {rc}): a kernel bug")
    return o


def _fp8_values(layout):
    """The e4m3fn codes' values for an fp8 layout (the C decoders look codes up in it), else None."""
    return quantize.fp8_values_table() if layout.dtype == "fp8_e4m3" else None

