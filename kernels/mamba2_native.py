"""The Mamba2 decode kernels in C (kernels/native/mamba2_decode.c), called through ctypes.

Why: torch updates a decode state in three passes over it (decay, rank-1 add, read-out by C) and
spends tens of microseconds of dispatch on each of the layer's small steps (conv window shift,
dt, skip, gate, norm); the C loop reads and writes each state once and does the rest in the same
pass over the request. Same contracts as the torch paths (mamba2_cpu.py, causal_conv_cpu.py, the
gated RMSNorm of models/norms.py).

Each function returns None when it cannot run here and the caller runs its torch path: native
kernels off (`HYBRIDKV_CPU_NATIVE=0`, `native_cpu.forced_off()`) or not built, a tensor that is
not fp32 on the CPU, a layout the kernel does not take (inner dims not contiguous), or slots
that repeat or fall outside the pool (the torch path defines those cases).
"""
from __future__ import annotations

import ctypes

import torch

from . import native_cpu, quantize
from .native_args import F32, I64, INT, CFunction, Ptr, as_rows, f32, fp32_cpu, i32, ptr, slots_int32

_P = ctypes.c_void_p
# native/mamba2_decode.c, declared parameter by parameter (native_args.py)
CONV1D_UPDATE = CFunction(
    "mamba2_decode", "conv1d_update", INT,
    conv_state=f32("num_slots", "dim", "k - 1"), num_slots=I64, slots=i32("nb"), nb=I64, dim=I64, k=I64,
    x=f32("nb", "dim", strides=("x_row", 1)), x_row=I64, weight=f32("dim", "k"), bias=f32("dim", optional=True),
    act=INT, y=f32("nb", "dim", strides=("y_row", 1), new=True), y_row=I64)
CONV1D_UPDATE_Q = CFunction(  # over a quantized pool (gdn_quantized.py)
    "mamba2_decode", "conv1d_update_q", INT,
    pool=Ptr(torch.uint8, ("num_slots", "nbytes")), num_slots=I64, slots=i32("nb"), nb=I64, dim=I64, k=I64,
    nbytes=I64, code_bytes=I64, A=I64, L=I64, B=I64, fp8_values=f32(256, optional=True),
    x=f32("nb", "dim", strides=("x_row", 1)), x_row=I64, weight=f32("dim", "k"), bias=f32("dim", optional=True),
    act=INT, y=f32("nb", "dim", strides=("y_row", 1), new=True), y_row=I64, window=f32("dim * (k - 1)", new=True))
MAMBA2_STATE_UPDATE = CFunction(
    "mamba2_decode", "mamba2_state_update", INT,
    state=f32("num_slots", "H", "P", "N"), num_slots=I64, slots=i32("nb"), nb=I64, H=I64, P=I64, N=I64, G=I64,
    x=f32("nb", "H", "P", strides=("x_row", "P", 1)), x_row=I64, dt=f32("nb", "H", strides=("dt_row", 1)),
    dt_row=I64, B=f32("nb", "G", "N", strides=("B_row", "N", 1)), B_row=I64,
    C=f32("nb", "G", "N", strides=("C_row", "N", 1)), C_row=I64,
    z=f32("nb", "H", "P", strides=("z_row", "P", 1), optional=True), z_row=I64,
    A=f32("H"), dt_bias=f32("H", optional=True), D=f32("H", optional=True), dt_softplus=INT, has_limit=INT,
    dt_min=F32, dt_max=F32, y=f32("nb", "H", "P", new=True))


class _MixerArgs(ctypes.Structure):
    """struct mamba2_mixer_args of kernels/native/mamba2_decode.c, field for field."""
    _fields_ = [("proj", _P), ("proj_row", I64), ("nb", I64), ("slots", _P), ("y", _P),
                ("conv_state", _P), ("ssm_state", _P), ("num_slots", I64), ("H", I64), ("P", I64),
                ("N", I64), ("G", I64), ("k", I64), ("conv_w", _P), ("conv_b", _P), ("A_log", _P),
                ("dt_bias", _P), ("D", _P), ("norm_w", _P), ("norm_group", I64), ("eps", F32),
                ("norm_mode", ctypes.c_int32), ("xbc", _P), ("A", _P),
                ("conv_q", _P), ("ssm_q", _P), ("conv_nbytes", I64), ("conv_code_bytes", I64), ("conv_A", I64),
                ("conv_L", I64), ("conv_B", I64), ("ssm_nbytes", I64), ("ssm_code_bytes", I64),
                ("conv_fp8", ctypes.c_int32), ("ssm_fp8", ctypes.c_int32),
                ("fp8_values", _P)]


_MIXER_DECODE = ("mamba2_decode", "mamba2_mixer_decode", [ctypes.POINTER(_MixerArgs)], INT)
_functions: dict = {}  # symbol -> the mixer's C function or None (benchmarks set None to force torch)


def conv1d_update_native(x, conv_state, weight, bias, slot_idx, activation="silu"):
    """As `conv1d_update_cpu`: x [B, dim]; conv_state [S, dim, k-1] (updated in place);
    weight [dim, k]; bias [dim] or None -> [B, dim] fp32, or None (see the module docstring)."""
    if not CONV1D_UPDATE.available() or activation not in (None, "silu", "swish") or x.ndim != 2:
        return None
    if not (fp32_cpu(x, conv_state, weight, bias) and conv_state.is_contiguous()
            and weight.is_contiguous() and (bias is None or bias.is_contiguous())):
        return None
    nb, dim = x.shape
    k = weight.shape[1]
    x = as_rows(x, (dim,))
    rc, y = CONV1D_UPDATE.call(conv_state=conv_state, num_slots=conv_state.shape[0], slots=slots_int32(slot_idx),
                            nb=nb, dim=dim, k=k, x=x, x_row=x.stride(0), weight=weight, bias=bias,
                            act=activation is not None)
    return y if rc == 0 else None


def mamba2_state_update_native(ssm_state, x, dt, A, B, C, D, z, dt_bias, slot_idx, dt_softplus=True,
                               dt_limit=None):
    """As `mamba2_state_update_ref`: ssm_state [S, H, P, N] (updated in place); x [B, H, P];
    dt [B, H]; A [H]; B, C [B, G, N]; D [H] or None; z [B, H, P] or None; dt_bias [H] or None
    -> y [B, H, P] fp32, or None (see the module docstring)."""
    if not MAMBA2_STATE_UPDATE.available() or not fp32_cpu(ssm_state, x, dt, A, B, C, D, z, dt_bias):
        return None
    nb, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    if H % G or not ssm_state.is_contiguous() or tuple(ssm_state.shape[1:]) != (H, P, N):
        return None
    x, dt, B, C = (as_rows(t, inner) for t, inner in ((x, (H, P)), (dt, (H,)), (B, (G, N)), (C, (G, N))))
    z = None if z is None else as_rows(z, (H, P))
    A, D, dt_bias = (None if t is None else t.contiguous() for t in (A, D, dt_bias))
    lo, hi = (float(dt_limit[0]), float(dt_limit[1])) if dt_limit is not None else (0.0, 0.0)
    rc, y = MAMBA2_STATE_UPDATE.call(
        state=ssm_state, num_slots=ssm_state.shape[0], slots=slots_int32(slot_idx), nb=nb, H=H, P=P, N=N, G=G,
        x=x, x_row=x.stride(0), dt=dt, dt_row=dt.stride(0), B=B, B_row=B.stride(0), C=C, C_row=C.stride(0),
        z=z, z_row=0 if z is None else z.stride(0), A=A, dt_bias=dt_bias, D=D, dt_softplus=bool(dt_softplus),
        has_limit=dt_limit is not None, dt_min=lo, dt_max=hi)
    return y if rc == 0 else None


class Mamba2MixerDecode:
    """One Mamba2 layer's decode between in_proj and out_proj in C, over given pools and weights.

    conv_state [S, conv_dim, k-1] and ssm_state [S, H, P, N]: the layer's pools (updated in place);
    conv_weight [conv_dim, k]; conv_bias [conv_dim] or None; A_log, dt_bias, D [H] (A = -exp(A_log);
    dt: + bias, softplus, no clamp); norm_mode 1: norm(y silu(z)) w, 2: norm(y) w silu(z) (RMS over
    groups of norm_group with eps; norm_weight [H P]), 0: y silu(z) (norm_weight None).
    Built once per layer and pools: dtypes, layouts and shapes are checked once and the static
    arguments kept (a call with ~25 ctypes arguments costs more than the work at batch 1); a call
    sets only the step's rows and slots. `key_of(...)` tells the caller when to build another one.
    """

    def __init__(self, conv_state, ssm_state, num_heads, head_dim, n_groups, conv_weight, conv_bias,
                 A_log, dt_bias, D, norm_weight, norm_group, eps, norm_mode, quantized=None):
        H, P, G = num_heads, head_dim, n_groups
        conv_dim, k = conv_weight.shape
        quant_ok = True
        if quantized is not None:  # the pools are codes: the float "pools" are one slot of scratch
            conv_q, conv_layout, ssm_q, ssm_layout = quantized
            quant_ok = quantize.is_quantized_pool(conv_q, conv_layout, (conv_dim, k - 1)) and \
                quantize.is_quantized_pool(ssm_q, ssm_layout, (H, P, ssm_layout.shape[-1])) and \
                conv_q.shape[0] == ssm_q.shape[0]
            conv_state = torch.empty(1, *conv_layout.shape, dtype=torch.float32)
            ssm_state = torch.empty(1, *ssm_layout.shape, dtype=torch.float32)
        N = ssm_state.shape[-1]
        self.width = H * P + conv_dim + H
        tensors = (conv_state, ssm_state, conv_weight, conv_bias, A_log, dt_bias, D, norm_weight)
        self.usable = (quant_ok and fp32_cpu(*tensors) and all(t is None or t.is_contiguous() for t in tensors)
                       and conv_state.shape[0] == ssm_state.shape[0] and H % G == 0
                       and tuple(conv_state.shape[1:]) == (conv_dim, k - 1)
                       and tuple(ssm_state.shape[1:]) == (H, P, N) and conv_dim == H * P + 2 * G * N)
        self._xbc, self._A = torch.empty(conv_dim, dtype=torch.float32), torch.empty(H, dtype=torch.float32)
        self._scratch = (conv_state, ssm_state)  # (kept alive: the call holds their addresses)
        a = self._args = _MixerArgs()
        a.conv_state, a.ssm_state = conv_state.data_ptr(), ssm_state.data_ptr()
        a.num_slots = ssm_state.shape[0]
        if quantized is not None and self.usable:
            a.num_slots = conv_q.shape[0]
            a.conv_q, a.ssm_q = conv_q.data_ptr(), ssm_q.data_ptr()
            a.conv_nbytes, a.conv_code_bytes = conv_layout.nbytes, conv_layout.code_bytes
            a.conv_A, a.conv_L, a.conv_B = quantize.layout_dims(conv_layout)
            a.ssm_nbytes, a.ssm_code_bytes = ssm_layout.nbytes, ssm_layout.code_bytes
            a.conv_fp8, a.ssm_fp8 = conv_layout.dtype == "fp8_e4m3", ssm_layout.dtype == "fp8_e4m3"
            if a.conv_fp8 or a.ssm_fp8:
                self._fp8 = quantize.fp8_values_table()
                a.fp8_values = self._fp8.data_ptr()
        a.H, a.P, a.N, a.G, a.k = H, P, N, G, k
        a.conv_w, a.conv_b, a.A_log, a.dt_bias, a.D, a.norm_w = (ptr(t) for t in tensors[2:])
        a.norm_group, a.eps, a.norm_mode = norm_group, eps, norm_mode
        a.xbc, a.A = self._xbc.data_ptr(), self._A.data_ptr()

    @staticmethod
    def key_of(*tensors) -> list:
        """What a built call depends on: each tensor's address, shape, strides and dtype. It keeps
        no reference to them (a pool freed by its engine is not held here); the caller passes the
        live tensors and rebuilds the call when their key differs, so a pointer it keeps is used
        only while a tensor with that very layout lives there. (~0.5 us a tensor: the four reads;
        a list comprehension, ~10% under a tuple of a generator.)"""
        return [None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors]

    def __call__(self, proj: torch.Tensor, slot_idx: torch.Tensor) -> torch.Tensor | None:
        """proj [B, H P + conv_dim + H] (in_proj's rows [z | xBC | dt]); slot_idx [B] ->
        y [B, H P] fp32 (out_proj's input), or None (see the module docstring)."""
        fn = _mixer_decode()
        if fn is None or not self.usable or proj.dtype != torch.float32 or not proj.is_cpu \
                or proj.dim() != 2 or proj.shape[1] != self.width or proj.stride(1) != 1:
            return None
        nb = proj.shape[0]
        slots = slots_int32(slot_idx)
        y = torch.empty(nb, self._args.H * self._args.P, dtype=torch.float32)
        a = self._args
        a.proj, a.proj_row, a.nb = proj.data_ptr(), proj.stride(0), nb
        a.slots, a.y = slots.data_ptr(), y.data_ptr()
        rc = fn(ctypes.byref(a))
        return y if rc == 0 else None


def mamba2_mixer_decode_q(proj, slot_idx, *, conv_pool, conv_layout, ssm_pool, ssm_layout, num_heads, head_dim,
                          n_groups, conv_weight, conv_bias, A_log, dt_bias, D, norm_weight, norm_group, eps,
                          norm_mode, cache: dict):
    """ops.mamba2_mixer_decode_q on CPU: mamba2_mixer_decode over quantized pools read and written
    in place (conv_pool [S, conv nbytes], ssm_pool [S, ssm nbytes] uint8 with their layouts,
    hybridkv.cache_dtype.QuantLayout): each request's slot decoded, updated and encoded back in
    one pass, the bytes and y of decoding the pools, running mamba2_mixer_decode and encoding the
    slots after (slot 0, the null slot, is not written back). -> y [B, H P] fp32, or None when it
    cannot run here (nothing written: the caller decodes the slots and runs the float path)."""
    if not native_cpu.enabled():
        return None
    key = Mamba2MixerDecode.key_of(conv_pool, ssm_pool, conv_weight, conv_bias, A_log, dt_bias, D, norm_weight)
    key.append((id(conv_layout), id(ssm_layout)))
    call = cache.get("call_q")
    if call is None or cache["key_q"] != key:
        call = cache["call_q"] = Mamba2MixerDecode(
            None, None, num_heads, head_dim, n_groups,
            conv_weight.squeeze(1) if conv_weight.dim() == 3 else conv_weight, conv_bias, A_log, dt_bias, D,
            norm_weight, norm_group, eps, norm_mode, quantized=(conv_pool, conv_layout, ssm_pool, ssm_layout))
        cache["key_q"] = key
        cache["layouts_q"] = (conv_layout, ssm_layout)  # (their ids are in the key: kept alive)
    return call(proj, slot_idx)


def _mixer_decode():
    """The C function of Mamba2MixerDecode (its argtypes: a pointer to _MixerArgs, nothing else),
    or None when native kernels are off or not built."""
    if not native_cpu.enabled():
        return None
    if "mamba2_mixer_decode" not in _functions:
        _functions["mamba2_mixer_decode"] = native_cpu.function(*_MIXER_DECODE)
    return _functions["mamba2_mixer_decode"]


def mamba2_mixer_decode(proj, slot_idx, *, conv_state, ssm_state, num_heads, head_dim, n_groups, conv_weight,
                        conv_bias, A_log, dt_bias, D, norm_weight, norm_group, eps, norm_mode, cache: dict,
                        plan_cache=None):
    """ops.mamba2_mixer_decode on CPU: a Mamba2 layer's decode between in_proj and out_proj, one C
    call. proj [B, H P + conv_dim + H], slot_idx [B]; the rest as Mamba2MixerDecode (conv_weight
    [conv_dim, k] or nn.Conv1d's [conv_dim, 1, k]) -> y [B, H P] fp32, or None when it cannot run
    here (the caller's torch path runs). cache: a dict the layer owns, where the call built for its
    pools and weights is kept (built again when one of them is another tensor); plan_cache: the
    step's (the op's backend)."""
    if not native_cpu.enabled():
        return None
    key = Mamba2MixerDecode.key_of(conv_state, ssm_state, conv_weight, conv_bias, A_log, dt_bias, D, norm_weight)
    call = cache.get("call")
    if call is None or cache["key"] != key:
        call = cache["call"] = Mamba2MixerDecode(
            conv_state, ssm_state, num_heads, head_dim, n_groups,
            conv_weight.squeeze(1) if conv_weight.dim() == 3 else conv_weight,  # a view: its address is kept
            conv_bias, A_log, dt_bias, D, norm_weight, norm_group, eps, norm_mode)
        cache["key"] = key
    return call(proj, slot_idx)
