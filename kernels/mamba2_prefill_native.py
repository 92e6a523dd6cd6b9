"""The elementwise steps of the Mamba2 prefill in C (kernels/native/mamba2_prefill.c), via ctypes.

Why: between its matmuls the chunked SSD makes several passes over memory per step in torch (a
causal mask, a cut mask, exp, the C.B product; pad then scale then carry; mul, add, index, copy
back per chunk of the recurrence; decay, add, gather, skip on the way out), and the causal conv
makes k + 4 (shifted multiply-adds, bias, gather, silu). Each is one pass in C; the matmuls stay
in torch. Used by mamba2_cpu.mamba2_chunk_scan_cpu and causal_conv_cpu.causal_conv1d_cpu, which
keep their torch code as the fallback and the specification.

`usable(...)` says whether the C path may run: native kernels on (not `HYBRIDKV_CPU_NATIVE=0`,
not inside `native_cpu.forced_off()`), built here, and every tensor fp32 on the CPU, none that
autograd must follow (grad mode on and requires_grad). The other functions assume it said yes
and take the layouts they document (they make a tensor contiguous where it is not).
Checked against the torch path and the references in tests/kernels/test_mamba2_cpu.py and
test_causal_conv_cpu.py (both paths, tests/prefill_paths.py).
"""
from __future__ import annotations

import ctypes

import torch

from . import native_cpu

_P, _I, _F, _B = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "ssd_inputs": [_P, _I, _P, _P, _P, _I, _I, _I, _I, _F, _P, _P, _P],
    "ssd_scores": [_P, _P, _I, _I, _I, _I, _F, _P],
    "ssd_chain": [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _F, _P],
    "ssd_output": [_P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _F, _P],
    "causal_conv": [_P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _P, _P, _B, _P],
}
_functions: dict = {}


def _fn(symbol: str):
    if symbol not in _functions:
        _functions[symbol] = native_cpu.function("mamba2_prefill", symbol, _SIGNATURES[symbol])
    return _functions[symbol]


def usable(*tensors) -> bool:
    """Whether the C kernels may run on these tensors (None entries are ignored)."""
    if not native_cpu.enabled():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu"
                              or (grad and t.requires_grad)):
            return False
    return _fn("ssd_scores") is not None


def _ptr(t):
    return None if t is None else t.data_ptr()


def _heads_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, P] with each row's H * P values contiguous (any row stride)."""
    T, H, P = x.shape
    return x if x.stride(2) == 1 and (x.stride(1) == P or H == 1) else x.contiguous()


def ssd_inputs(x, dtf, A, lay, cut: float):
    """x [T, H, P]; dtf [T, H] discretised dt; A [H] -> (acum [nc, cs, H], xdt [nc, H, cs, P]
    (heads first), xend [nc, cs, H, P]: x dt carried to its chunk's end), in the padded chunk
    layout `lay`."""
    x = _heads_rows(x)
    T, H, P = x.shape
    nc, cs = lay.num_chunks, lay.chunk
    dtf, A = dtf.contiguous(), A.contiguous()
    acum = torch.empty(nc, cs, H)
    xdt, xend = torch.empty(nc, H, cs, P), torch.empty(nc, cs, H, P)
    _fn("ssd_inputs")(x.data_ptr(), x.stride(0), dtf.data_ptr(), A.data_ptr(), lay.source_rows.data_ptr(),
                      nc, cs, H, P, cut, acum.data_ptr(), xdt.data_ptr(), xend.data_ptr())
    return acum, xdt, xend


def ssd_scores(acum, cb, num_heads: int, cut: float):
    """acum [nc, cs, H]; cb [nc, G, cs, cs] (C.B per group) -> [nc, H, cs, cs]: decay x C.B below
    and on the diagonal, 0 above."""
    nc, cs, _ = acum.shape
    G = cb.shape[1]
    cb = cb.contiguous()
    out = torch.empty(nc, num_heads, cs, cs)
    _fn("ssd_scores")(acum.data_ptr(), cb.data_ptr(), nc, cs, num_heads, G, cut, out.data_ptr())
    return out


def ssd_chain(ends, acum, h0, lay, cut: float):
    """ends [nc, H, P, N] (each chunk's own inputs at its end) becomes the state entering each chunk,
    in place; h0 [R, H, P, N] (read for requests with `lay.init`) or None. Returns finals [R, H, P, N]."""
    nc, H, P, N = ends.shape
    R = lay.slots.shape[0]
    finals = torch.empty(R, H, P, N)
    h0 = None if h0 is None else h0.contiguous()
    _fn("ssd_chain")(ends.data_ptr(), acum.data_ptr(), _ptr(h0), lay.init.data_ptr(),
                     lay.first.data_ptr(), lay.count.data_ptr(), R, lay.chunk, H, P * N, cut,
                     finals.data_ptr())
    return finals


def ssd_output(y_in, y_intra, acum, x, D, lay, cut: float):
    """y_in [nc, G, cs, H/G * P] (the entering states read by C); y_intra [nc, H, cs, P]; x [T, H, P];
    D [H] or None -> [T, H, P]: exp(acum) y_in + y_intra + D x per token (D x where no request)."""
    x = _heads_rows(x)
    T, H, P = x.shape
    G = y_in.shape[1]
    out = torch.empty(T, H, P)
    D = None if D is None else D.contiguous()
    _fn("ssd_output")(y_in.contiguous().data_ptr(), y_intra.contiguous().data_ptr(), acum.data_ptr(),
                      x.data_ptr(), x.stride(0), _ptr(D), lay.padded_row_of(T).data_ptr(), T,
                      lay.chunk, H, P, G, cut, out.data_ptr())
    return out


def causal_conv(x, conv_state, weight, bias, spans, activation):
    """As `causal_conv_cpu.causal_conv1d_cpu` for fp32, spans (from `varlen.request_spans`) tiling
    the rows of x in order: x [T, dim]; conv_state [S, dim, k-1] contiguous, windows written in
    place; weight [dim, k]; bias [dim] or None; activation None or "silu" -> [T, dim] fp32."""
    T, dim = x.shape
    k = weight.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    start, end, slot = (torch.tensor(c, dtype=torch.int64) for c in list(zip(*spans))[:3])
    init = torch.tensor([bool(i) for *_, i in spans], dtype=torch.uint8)
    out = torch.empty(T, dim)
    weight, bias = weight.contiguous(), None if bias is None else bias.contiguous()
    _fn("causal_conv")(x.data_ptr(), x.stride(0), conv_state.data_ptr(), start.data_ptr(),
                       end.data_ptr(), slot.data_ptr(), init.data_ptr(), len(spans), dim, k,
                       weight.data_ptr(), _ptr(bias), activation is not None, out.data_ptr())
    return out
