"""kernels/native_args.py: every C kernel is declared with its types and called by name; a swapped,
missing or wrong argument raises before the C loop runs (instead of writing through a bad pointer).
The arguments reach C packed in one struct through a generated entry point: its layout is asserted
in C, the declaration is checked against the prototype by the compiler, a scalar that does not fit
its C type raises, and the outputs the call allocates are of the declared shape."""
import ctypes
import struct

import pytest
import torch

from hybridkv.kernels import (attention_decode_native, mamba2_native, mamba2_prefill_native, native_cpu,
                              recurrent_native, rms_norm, write_kv_cpu)
from hybridkv.kernels.native_args import F32, I64, INT, CFunction, Ptr, f32

MODULES = (attention_decode_native, mamba2_native, mamba2_prefill_native, recurrent_native, rms_norm,
           write_kv_cpu)
DECLARED = [(m.__name__.rsplit(".", 1)[1], name, cf) for m in MODULES for name, cf in vars(m).items()
            if isinstance(cf, CFunction)]

needs_native = pytest.mark.skipif(not native_cpu.enabled(), reason="native kernels off (HYBRIDKV_CPU_NATIVE=0)")


def test_every_binding_is_declared():
    assert len(DECLARED) == 16  # + Mamba2MixerDecode's struct call, checked below


@needs_native
@pytest.mark.parametrize("module,name,cf", DECLARED, ids=[f"{m}.{n}" for m, n, _ in DECLARED])
def test_each_c_function_has_argtypes_and_restype(module, name, cf):
    fn = cf.function()
    assert fn is not None, f"{cf.library}.c did not build"
    assert list(fn.argtypes) == [ctypes.c_char_p] == cf.argtypes  # the packed struct of every parameter
    assert fn.restype is cf.restype
    assert cf.source.count(f"a->") == len(cf.params)


@needs_native
def test_mixer_decode_takes_only_its_struct():
    fn = mamba2_native._mixer_decode()
    assert fn.restype is ctypes.c_int
    with pytest.raises(ctypes.ArgumentError):
        fn(12345)  # an address is not a struct mamba2_mixer_args *


def test_function_refuses_a_missing_signature():
    with pytest.raises(TypeError, match="argtypes"):
        native_cpu.function("rms_norm", "rms_norm_f32", None, None)


def _mamba1_args(nb=2, d=6, N=4, S=5):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(state=r(S, d, N), num_slots=S, slots=torch.tensor([3, 1], dtype=torch.int32), nb=nb, d=d, N=N,
                x=r(nb, d), x_row=d, dt=r(nb, d), dt_row=d, A=-r(d, N).abs(), B=r(nb, N), B_row=N,
                C=r(nb, N), C_row=N, D=r(d), z=None, z_row=0, dt_bias=r(d), dt_softplus=True)


@needs_native
def test_a_correct_call_runs():
    args = _mamba1_args()
    rc, y = recurrent_native.MAMBA1_STATE_UPDATE.call(**args)
    assert rc == 0 and y.shape == (2, 6) and y.dtype == torch.float32 and y.is_contiguous()
    assert torch.isfinite(y).all()


@needs_native
@pytest.mark.parametrize("change,error,match", [
    (lambda a: a.update(x=a["B"], B=a["x"]), ValueError, "argument x: expected shape"),  # swapped
    (lambda a: a.update(slots=a["slots"].long()), TypeError, "argument slots: expected torch.int32"),
    (lambda a: a.update(x=a["x"].double()), TypeError, "argument x: expected torch.float32"),
    (lambda a: a.update(d=7), ValueError, "expected shape"),  # a size that is not the tensors'
    (lambda a: a.update(x_row=a["x_row"] + 1), ValueError, "argument x: expected strides"),
    (lambda a: a.update(state=a["state"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
     "argument state: expected a contiguous tensor"),
    (lambda a: a.update(x=a["x"].tolist()), TypeError, "not a tensor"),
    (lambda a: a.update(x=a["x"].to("meta")), TypeError, "argument x: expected torch.float32 on the CPU"),
    (lambda a: a.update(D=torch.ones(3)), ValueError, "argument D: expected shape"),
    (lambda a: a.pop("dt_bias"), TypeError, "dt_bias"),  # missing
    (lambda a: a.update(bias=None), TypeError, "bias"),  # unknown
    (lambda a: a.update(y=torch.empty(2, 6)), TypeError, "'y'"),  # an output the call allocates
    (lambda a: a.update(x_row=6.0), TypeError, "argument x_row: expected a C int64_t"),  # packed: a float
    (lambda a: a.update(z_row=2 ** 64), TypeError, "argument z_row: expected a C int64_t"),  # z is None
    (lambda a: a.update(dt_softplus=2 ** 40), TypeError, "argument dt_softplus: expected a C int"),
    (lambda a: a.update(dt_softplus="yes"), TypeError, "argument dt_softplus"),
])
def test_a_wrong_argument_raises_and_writes_nothing(change, error, match):
    args = _mamba1_args()
    before = args["state"].clone()
    change(args)
    with pytest.raises(error, match=match):
        recurrent_native.MAMBA1_STATE_UPDATE.call(**args)
    if args.get("state") is not None and args["state"].is_contiguous():
        torch.testing.assert_close(args["state"], before, rtol=0, atol=0)


@needs_native
def test_sizes_not_given_are_checked_between_tensors():
    """paged_decode_attention's T (q's rows) must be out's too; R (the table's rows) seq_lens' length."""
    T, Hkv, group, D, bs, nblocks = 3, 2, 2, 8, 4, 6
    q, out = torch.randn(T, Hkv * group, D), torch.empty(T + 1, Hkv * group, D)
    kv = torch.randn(nblocks, 2, bs, Hkv, D)
    st = kv.stride()
    args = dict(q=q, q_tok=q.stride(0), q_head=q.stride(1), kv=kv, num_blocks=nblocks, kv_blk=st[0],
                kv_half=st[1], kv_pos=st[2], kv_head=st[3],
                table=torch.zeros(2, 3, dtype=torch.int32), table_row=3, seq_lens=torch.ones(2, dtype=torch.int32),
                reqs=torch.zeros(1, dtype=torch.int32), rows=torch.zeros(1, dtype=torch.int32), n=1, hkv=Hkv,
                group=group, d=D, bs=bs, scale=0.5, soft_cap=0.0, window=0, sinks=None,
                out=out, out_tok=out.stride(0), out_head=out.stride(1))
    with pytest.raises(ValueError, match="argument out: expected shape"):
        attention_decode_native.PAGED_DECODE_ATTENTION.call(**args)
    args.update(out=torch.empty(T, Hkv * group, D), out_tok=Hkv * group * D,
                seq_lens=torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="argument seq_lens: expected shape"):
        attention_decode_native.PAGED_DECODE_ATTENTION.call(**args)
    args.update(seq_lens=torch.ones(2, dtype=torch.int32))
    assert attention_decode_native.PAGED_DECODE_ATTENTION.call(**args) == 0


@needs_native
def test_rms_norm_out_of_the_wrong_shape_raises():
    x, w = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(ValueError, match="argument x: expected shape"):  # out is [n, d]: n is x's
        rms_norm.RMS_NORM.call(x=x, x_stride=8, w=w, plus_one=False, n=1, d=8, eps=1e-6)
    out = rms_norm.RMS_NORM.call(x=x, x_stride=8, w=w, plus_one=False, n=2, d=8, eps=1e-6)
    assert out.shape == (2, 8) and out.stride() == (8, 1)


def test_calling_when_native_kernels_are_off_raises():
    m1 = recurrent_native.MAMBA1_STATE_UPDATE
    fresh = CFunction(m1.library, m1.symbol, m1.restype, **m1.params)  # nothing loaded yet
    with native_cpu.forced_off():
        assert not fresh.available()
        with pytest.raises(RuntimeError, match="available"):
            fresh.call(**_mamba1_args())


@needs_native
def test_packed_layout_is_the_c_structs():
    """The generated C asserts the struct's size and every field's offset against the packer's."""
    cf = rms_norm.ADD_RMS_NORM
    assert f"== {cf.packer.size}, \"size\"" in cf.source and cf.source.count("_Static_assert(offsetof") == 13
    assert cf.packer.size == struct.calcsize("@PqPqPiPqPqqqf0q")


@needs_native
@pytest.mark.slow  # compiles a library
def test_a_declaration_that_does_not_match_the_prototype_does_not_build(tmp_path, monkeypatch):
    """The entry point calls the kernel with the declared types: a pointer of another element type,
    a narrowing scalar or a missing parameter is a compile error, so the function is unavailable."""
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(tmp_path))
    good = dict(x=f32("n", "d", strides=("x_stride", 1)), x_stride=I64, w=f32("d"), plus_one=INT,
                out=f32("n", "d", strides=("out_stride", 1), new=True), out_stride=I64, n=I64, d=I64, eps=F32)
    assert CFunction("rms_norm", "rms_norm_f32", None, **good).available()
    for change in (dict(w=Ptr(torch.int32, ("d",))), dict(eps=I64), dict(x_stride=F32)):
        assert not CFunction("rms_norm", "rms_norm_f32", None, **{**good, **change}).available(), change
    assert not CFunction("rms_norm", "rms_norm_f32", None, **{k: v for k, v in good.items() if k != "eps"}).available()
    assert not CFunction("rms_norm", "rms_norm_f32", INT, **good).available()  # a void function


@needs_native
@pytest.mark.parametrize("bad,error,match", [
    (dict(h=torch.randn(1, 256, dtype=torch.float64)), TypeError, "argument h: expected torch.float32"),
    (dict(delta=torch.randn(1, 512)[:, ::2]), ValueError, "argument delta: expected strides"),
    (dict(delta=torch.randn(1, 255)), ValueError, "argument delta: expected shape"),
    (dict(w=torch.randn(128)), ValueError, "argument w: expected shape"),
    (dict(w=torch.randn(512)[::2]), ValueError, "argument w: expected a contiguous tensor"),
    (dict(d=255), ValueError, "expected shape"),
    (dict(n=2), ValueError, "expected shape"),  # too few rows for the outputs it would allocate
    (dict(eps="1e-6"), TypeError, "argument eps: expected a C float"),
])
def test_the_norm_row_a_decode_step_calls_still_raises(bad, error, match):
    """The fast path of a batch-1 step (add + RMSNorm of one row, outputs allocated by the call,
    arguments packed) checks every tensor and scalar it is given."""
    h, delta, w = torch.randn(1, 256), torch.randn(1, 256), torch.randn(256)
    args = dict(h=h, h_stride=256, delta=delta, delta_stride=256, w=w, plus_one=False, n=1, d=256, eps=1e-6)
    args.update(bad)
    with pytest.raises(error, match=match):
        rms_norm.ADD_RMS_NORM.call(**args)
    s, out = rms_norm.ADD_RMS_NORM.call(h=h, h_stride=256, delta=delta, delta_stride=256, w=w, plus_one=False,
                                        n=1, d=256, eps=1e-6)
    torch.testing.assert_close(s, h + delta)
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(h + delta, (256,), w, 1e-6))


@needs_native
def test_replaced_runs_another_build_of_the_entry_point_or_none():
    """Benchmarks compare builds: another library built with the declaration's entry point."""
    cf = rms_norm.RMS_NORM
    lib = native_cpu.library(cf.library, extra=cf.source)
    other = lib[cf.entry]
    other.argtypes, other.restype = cf.argtypes, cf.restype
    x, w = torch.randn(2, 8), torch.randn(8)
    with cf.replaced(other):
        out = cf.call(x=x, x_stride=8, w=w, plus_one=False, n=2, d=8, eps=1e-6)
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(x, (8,), w, 1e-6))
    with cf.replaced(None):
        assert not cf.available()
    assert cf.available()
