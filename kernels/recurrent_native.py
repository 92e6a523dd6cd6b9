"""The Mamba1 and gated-delta-rule decode steps in C (kernels/native/mamba1_decode.c,
gdn_decode.c), called through ctypes: one pass over each state for Mamba1 (torch: the decay
tensor exp(dt A), then three passes), two for the gated delta rule (torch: five). GDN_STATE_UPDATE_Q,
the gated delta rule over a quantized pool, is called by gdn_quantized.py.

Same contracts as `mamba1_ref.mamba1_state_update_ref` and `gdn_ref.gdn_state_update_ref`.
Each function returns None when it cannot run here and the caller (mamba1_cpu.py, gdn_cpu.py)
runs its torch path: native kernels off (`HYBRIDKV_CPU_NATIVE=0`, `native_cpu.forced_off()`) or
not built, a tensor not fp32 on the CPU, a non-contiguous pool, or slots that repeat or fall
outside the pool.
"""
from __future__ import annotations

import torch

from .native_args import I64, INT, CFunction, Ptr, as_rows, f32, fp32_cpu, i32, slots_int32

# native/mamba1_decode.c and gdn_decode.c, declared parameter by parameter (native_args.py)
MAMBA1_STATE_UPDATE = CFunction(
    "mamba1_decode", "mamba1_state_update", INT,
    state=f32("num_slots", "d", "N"), num_slots=I64, slots=i32("nb"), nb=I64, d=I64, N=I64,
    x=f32("nb", "d", strides=("x_row", 1)), x_row=I64, dt=f32("nb", "d", strides=("dt_row", 1)), dt_row=I64,
    A=f32("d", "N"), B=f32("nb", "N", strides=("B_row", 1)), B_row=I64,
    C=f32("nb", "N", strides=("C_row", 1)), C_row=I64, D=f32("d", optional=True),
    z=f32("nb", "d", strides=("z_row", 1), optional=True), z_row=I64, dt_bias=f32("d", optional=True),
    dt_softplus=INT, y=f32("nb", "d", new=True))
GDN_STATE_UPDATE = CFunction(
    "gdn_decode", "gdn_state_update", INT,
    state=f32("num_slots", "HV", "K", "V"), num_slots=I64, slots=i32("nb"), nb=I64, HV=I64, K=I64, V=I64,
    q=f32("nb", "HV", "K"), k=f32("nb", "HV", "K"), v=f32("nb", "HV", "V", strides=("v_row", "V", 1)),
    v_row=I64, g=f32("nb", "HV", strides=("g_row", 1)), g_row=I64,
    beta=f32("nb", "HV", strides=("beta_row", 1)), beta_row=I64, o=f32("nb", "HV", "V", new=True),
    scratch=f32("2 * V", new=True))

GDN_STATE_UPDATE_Q = CFunction(  # over a quantized pool (gdn_quantized.py)
    "gdn_decode", "gdn_state_update_q", INT,
    pool=Ptr(torch.uint8, ("num_slots", "nbytes")), num_slots=I64, slots=i32("nb"), nb=I64, HV=I64, K=I64, V=I64,
    nbytes=I64, code_bytes=I64, fp8_values=f32(256, optional=True),
    q=f32("nb", "HV", "K"), k=f32("nb", "HV", "K"), v=f32("nb", "HV", "V", strides=("v_row", "V", 1)),
    v_row=I64, g=f32("nb", "HV", strides=("g_row", 1)), g_row=I64,
    beta=f32("nb", "HV", strides=("beta_row", 1)), beta_row=I64, o=f32("nb", "HV", "V", new=True),
    scratch=f32("2 * V + K * V", new=True))


def mamba1_state_update_native(ssm_state, x, dt, A, B, C, D, z, dt_bias, slot_idx, dt_softplus=True):
    """ssm_state [S, d, N] (updated in place); x, dt [B, d]; A [d, N]; B, C [B, N]; D [d] or None;
    z [B, d] or None; dt_bias [d] or None -> y [B, d] fp32, or None (see the module docstring)."""
    if not MAMBA1_STATE_UPDATE.available() or not fp32_cpu(ssm_state, x, dt, A, B, C, D, z, dt_bias) \
            or x.dim() != 2:
        return None
    nb, d = x.shape
    N = A.shape[-1]
    if not ssm_state.is_contiguous() or tuple(ssm_state.shape[1:]) != (d, N) or tuple(A.shape) != (d, N):
        return None
    x, dt, B, C = (as_rows(t, (n,)) for t, n in ((x, d), (dt, d), (B, N), (C, N)))
    z = None if z is None else as_rows(z, (d,))
    A, D, dt_bias = (None if t is None else t.contiguous() for t in (A, D, dt_bias))
    z_row = 0 if z is None else z.stride(0)
    rc, y = MAMBA1_STATE_UPDATE.call(
        state=ssm_state, num_slots=ssm_state.shape[0], slots=slots_int32(slot_idx), nb=nb, d=d, N=N,
        x=x, x_row=x.stride(0), dt=dt, dt_row=dt.stride(0), A=A, B=B, B_row=B.stride(0), C=C,
        C_row=C.stride(0), D=D, z=z, z_row=z_row, dt_bias=dt_bias, dt_softplus=bool(dt_softplus))
    return y if rc == 0 else None


def gdn_state_update_native(state, qf, kf, v, g, beta, slot_idx):
    """state [S, HV, K, V] (updated in place); qf, kf [B, HV, K] fp32, prepared as the reference
    does (l2-normalised, q scaled, repeated per value head); v [B, HV, V]; g, beta [B, HV]
    -> o [B, HV, V] fp32, or None (see the module docstring)."""
    if not GDN_STATE_UPDATE.available() or not fp32_cpu(state, qf, kf, v, g, beta) or v.dim() != 3:
        return None
    nb, HV, Vd = v.shape
    Kd = kf.shape[-1]
    if not state.is_contiguous() or tuple(state.shape[1:]) != (HV, Kd, Vd):
        return None
    qf, kf = qf.contiguous(), kf.contiguous()
    v, g, beta = as_rows(v, (HV, Vd)), as_rows(g, (HV,)), as_rows(beta, (HV,))
    rc, o, _ = GDN_STATE_UPDATE.call(
        state=state, num_slots=state.shape[0], slots=slots_int32(slot_idx), nb=nb, HV=HV, K=Kd, V=Vd,
        q=qf, k=kf, v=v, v_row=v.stride(0), g=g, g_row=g.stride(0), beta=beta, beta_row=beta.stride(0))
    return o if rc == 0 else None
