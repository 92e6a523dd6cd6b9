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

import torch

from . import native_cpu
from .native_args import F32, I64, INT, CFunction, Ptr, f32, flags, i64

# native/mamba2_prefill.c, declared parameter by parameter (native_args.py)
SSD_INPUTS = CFunction(
    "mamba2_prefill", "ssd_inputs", None,
    x=f32("T", "H", "P", strides=("x_row", "P", 1)), x_row=I64, dt=f32("T", "H"), A=f32("H"),
    src=i64("nc * cs"), nc=I64, cs=I64, H=I64, P=I64, cut=F32, acum=f32("nc", "cs", "H"),
    xdt=f32("nc", "H", "cs", "P"), xend=f32("nc", "cs", "H", "P"))
SSD_SCORES = CFunction(
    "mamba2_prefill", "ssd_scores", None,
    acum=f32("nc", "cs", "H"), cb=f32("nc", "G", "cs", "cs"), nc=I64, cs=I64, H=I64, G=I64, cut=F32,
    out=f32("nc", "H", "cs", "cs"))
SSD_CHAIN = CFunction(
    "mamba2_prefill", "ssd_chain", None,
    ends=f32("nc", "H", "PN"), acum=f32("nc", "cs", "H"), h0=f32("R", "H", "PN", optional=True),
    init=flags("R"), first=i64("R"), count=i64("R"), R=I64, cs=I64, H=I64, PN=I64, cut=F32,
    finals=f32("R", "H", "PN"))
SSD_OUTPUT = CFunction(
    "mamba2_prefill", "ssd_output", None,
    y_in=f32("nc", "G", "cs", "H // G * P"), y_intra=f32("nc", "H", "cs", "P"), acum=f32("nc", "cs", "H"),
    x=f32("T", "H", "P", strides=("x_row", "P", 1)), x_row=I64, D=f32("H", optional=True), dest=i64("T"),
    T=I64, cs=I64, H=I64, P=I64, G=I64, cut=F32, out=f32("T", "H", "P"))
CAUSAL_CONV = CFunction(
    "mamba2_prefill", "causal_conv", None,
    x=f32("T", "dim", strides=("x_row", 1)), x_row=I64, conv_state=f32("S", "dim", "k - 1"),
    start=i64("R"), end=i64("R"), slot=i64("R"), init=Ptr(torch.uint8, ("R",)), R=I64, dim=I64, k=I64,
    weight=f32("dim", "k"), bias=f32("dim", optional=True), act=INT, out=f32("T", "dim"))


def usable(*tensors) -> bool:
    """Whether the C kernels may run on these tensors (None entries are ignored)."""
    if not native_cpu.enabled():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu"
                              or (grad and t.requires_grad)):
            return False
    return SSD_SCORES.available()


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
    SSD_INPUTS.call(x=x, x_row=x.stride(0), dt=dtf, A=A, src=lay.source_rows, nc=nc, cs=cs, H=H, P=P, cut=cut,
                    acum=acum, xdt=xdt, xend=xend)
    return acum, xdt, xend


def ssd_scores(acum, cb, num_heads: int, cut: float):
    """acum [nc, cs, H]; cb [nc, G, cs, cs] (C.B per group) -> [nc, H, cs, cs]: decay x C.B below
    and on the diagonal, 0 above."""
    nc, cs, _ = acum.shape
    G = cb.shape[1]
    cb = cb.contiguous()
    out = torch.empty(nc, num_heads, cs, cs)
    SSD_SCORES.call(acum=acum, cb=cb, nc=nc, cs=cs, H=num_heads, G=G, cut=cut, out=out)
    return out


def ssd_chain(ends, acum, h0, lay, cut: float):
    """ends [nc, H, P, N] (each chunk's own inputs at its end) becomes the state entering each chunk,
    in place; h0 [R, H, P, N] (read for requests with `lay.init`) or None. Returns finals [R, H, P, N]."""
    nc, H, P, N = ends.shape
    R = lay.slots.shape[0]
    finals = torch.empty(R, H, P, N)
    h0 = None if h0 is None else h0.contiguous()
    PN = P * N
    SSD_CHAIN.call(ends=ends.view(nc, H, PN), acum=acum, h0=None if h0 is None else h0.view(R, H, PN),
                   init=lay.init, first=lay.first, count=lay.count, R=R, cs=lay.chunk, H=H, PN=PN, cut=cut,
                   finals=finals.view(R, H, PN))
    return finals


def ssd_output(y_in, y_intra, acum, x, D, lay, cut: float):
    """y_in [nc, G, cs, H/G * P] (the entering states read by C); y_intra [nc, H, cs, P]; x [T, H, P];
    D [H] or None -> [T, H, P]: exp(acum) y_in + y_intra + D x per token (D x where no request)."""
    x = _heads_rows(x)
    T, H, P = x.shape
    G = y_in.shape[1]
    out = torch.empty(T, H, P)
    D = None if D is None else D.contiguous()
    SSD_OUTPUT.call(y_in=y_in.contiguous(), y_intra=y_intra.contiguous(), acum=acum, x=x, x_row=x.stride(0),
                    D=D, dest=lay.padded_row_of(T), T=T, cs=lay.chunk, H=H, P=P, G=G, cut=cut, out=out)
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
    CAUSAL_CONV.call(x=x, x_row=x.stride(0), conv_state=conv_state, start=start, end=end, slot=slot, init=init,
                     R=len(spans), dim=dim, k=k, weight=weight, bias=bias, act=activation is not None, out=out)
    return out
