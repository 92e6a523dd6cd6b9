"""The Mamba1 and gated-delta-rule decode steps in C (kernels/native/mamba1_decode.c,
gdn_decode.c), called through ctypes: one pass over each state for Mamba1 (torch: the decay
tensor exp(dt A), then three passes), two for the gated delta rule (torch: five).

Same contracts as `mamba1_ref.mamba1_state_update_ref` and `gdn_ref.gdn_state_update_ref`.
Each function returns None when it cannot run here and the caller (mamba1_cpu.py, gdn_cpu.py)
runs its torch path: native kernels off (`HYBRIDKV_CPU_NATIVE=0`, `native_cpu.forced_off()`) or
not built, a tensor not fp32 on the CPU, a non-contiguous pool, or slots that repeat or fall
outside the pool.
"""
from __future__ import annotations

import ctypes

import torch

from . import native_cpu
from .native_args import as_rows, fp32_cpu, ptr, slots_int32

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    ("mamba1_decode", "mamba1_state_update"): [_P, _I, _P, _I, _I, _I, _P, _I, _P, _I, _P, _P, _I, _P, _I,
                                               _P, _P, _I, _P, ctypes.c_int, _P],
    ("gdn_decode", "gdn_state_update"): [_P, _I, _P, _I, _I, _I, _I, _P, _P, _P, _I, _P, _I, _P, _I, _P, _P],
}
_functions: dict = {}


def _fn(library: str, symbol: str):
    if not native_cpu.enabled():
        return None
    key = (library, symbol)
    if key not in _functions:
        _functions[key] = native_cpu.function(library, symbol, _SIGNATURES[key], ctypes.c_int)
    return _functions[key]


def mamba1_state_update_native(ssm_state, x, dt, A, B, C, D, z, dt_bias, slot_idx, dt_softplus=True):
    """ssm_state [S, d, N] (updated in place); x, dt [B, d]; A [d, N]; B, C [B, N]; D [d] or None;
    z [B, d] or None; dt_bias [d] or None -> y [B, d] fp32, or None (see the module docstring)."""
    fn = _fn("mamba1_decode", "mamba1_state_update")
    if fn is None or not fp32_cpu(ssm_state, x, dt, A, B, C, D, z, dt_bias) or x.dim() != 2:
        return None
    nb, d = x.shape
    N = A.shape[-1]
    if not ssm_state.is_contiguous() or tuple(ssm_state.shape[1:]) != (d, N) or tuple(A.shape) != (d, N):
        return None
    x, dt, B, C = (as_rows(t, (n,)) for t, n in ((x, d), (dt, d), (B, N), (C, N)))
    z = None if z is None else as_rows(z, (d,))
    A, D, dt_bias = (None if t is None else t.contiguous() for t in (A, D, dt_bias))
    y = torch.empty(nb, d)
    rc = fn(ssm_state.data_ptr(), ssm_state.shape[0], slots_int32(slot_idx).data_ptr(), nb, d, N,
            x.data_ptr(), x.stride(0), dt.data_ptr(), dt.stride(0), A.data_ptr(), B.data_ptr(), B.stride(0),
            C.data_ptr(), C.stride(0), ptr(D), ptr(z), 0 if z is None else z.stride(0), ptr(dt_bias),
            bool(dt_softplus), y.data_ptr())
    return y if rc == 0 else None


def gdn_state_update_native(state, qf, kf, v, g, beta, slot_idx):
    """state [S, HV, K, V] (updated in place); qf, kf [B, HV, K] fp32, prepared as the reference
    does (l2-normalised, q scaled, repeated per value head); v [B, HV, V]; g, beta [B, HV]
    -> o [B, HV, V] fp32, or None (see the module docstring)."""
    fn = _fn("gdn_decode", "gdn_state_update")
    if fn is None or not fp32_cpu(state, qf, kf, v, g, beta) or v.dim() != 3:
        return None
    nb, HV, Vd = v.shape
    Kd = kf.shape[-1]
    if not state.is_contiguous() or tuple(state.shape[1:]) != (HV, Kd, Vd):
        return None
    qf, kf = qf.contiguous(), kf.contiguous()
    v, g, beta = as_rows(v, (HV, Vd)), as_rows(g, (HV,)), as_rows(beta, (HV,))
    o = torch.empty(nb, HV, Vd)
    scratch = torch.empty(2 * Vd)
    rc = fn(state.data_ptr(), state.shape[0], slots_int32(slot_idx).data_ptr(), nb, HV, Kd, Vd,
            qf.data_ptr(), kf.data_ptr(), v.data_ptr(), v.stride(0), g.data_ptr(), g.stride(0),
            beta.data_ptr(), beta.stride(0), o.data_ptr(), scratch.data_ptr())
    return o if rc == 0 else None
