"""The gated delta rule's decode over quantized state pools (ops.gdn_decode_q, kernels/gdn_quantized.py:
each slot's conv window and state decoded, stepped and encoded back in place in C) against the torch
reference of the same arithmetic: the slots decoded by the layout's torch path, the float decode (the
torch references; and, value for value, the float path of the CPU ops, C kernels included), the written
slots encoded by the torch path after (the null slot 0 is not written back). Random inputs of many
magnitudes, a NaN row, int8 and fp8, rows of 16, 32 (the encode's copy for them) and 8, several blocks
of rows per head (dk 80 > the 64 rows encoded at once)."""
import pytest
import torch

from hybridkv.cache_dtype import conv_layout, state_layout
from hybridkv.kernels import native_cpu, ops
from hybridkv.kernels.conv1d_ref import conv1d_update_ref
from hybridkv.kernels.gdn_ref import gdn_state_update_ref

SLOTS, K = 9, 4


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def nan_equal(a, b) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def case(dtype, Hk, dk, HV, dv, seed):
    g = torch.Generator().manual_seed(seed)
    conv_dim = 2 * Hk * dk + HV * dv
    cl, sl = conv_layout(dtype, (conv_dim, K - 1)), state_layout(dtype, (HV, dk, dv))
    conv_vals = torch.randn(SLOTS, conv_dim, K - 1, generator=g) * torch.exp(
        torch.empty(SLOTS, 1, K - 1).uniform_(-4, 4, generator=g))
    state_vals = torch.randn(SLOTS, HV, dk, dv, generator=g) * torch.exp(
        torch.empty(SLOTS, HV, dk, 1).uniform_(-6, 6, generator=g))
    state_vals[5, 1, 2, 3] = float("nan")  # one row of slot 5 decodes to NaN
    weight = torch.randn(conv_dim, 1, K, generator=g) * 0.5  # nn.Conv1d's layout
    return g, cl, sl, cl.encode(conv_vals), sl.encode(state_vals), weight


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("Hk, dk, HV, dv", [(2, 16, 4, 16), (1, 32, 2, 32), (2, 80, 2, 8)])
def test_quantized_gdn_decode_matches_the_reference(dtype, Hk, dk, HV, dv):
    if native_cpu.library("gdn_decode") is None or native_cpu.library("mamba2_decode") is None:
        pytest.fail("kernels/native/gdn_decode.c and mamba2_decode.c must build on these machines")
    g, cl, sl, conv_q, state_q, weight = case(dtype, Hk, dk, HV, dv, seed=dk + dv + len(dtype))
    key_dim, conv_dim = Hk * dk, 2 * Hk * dk + HV * dv
    slots = torch.tensor([7, 0, 5, 2], dtype=torch.int32)  # slot 0, the null slot, is never written back
    written = torch.tensor([7, 5, 2])
    nb = len(slots)
    for step in range(3):
        mixed = torch.randn(nb, 3 + conv_dim, generator=g)[:, 3:] * 2  # strided rows
        gate = -torch.rand(nb, HV, generator=g) * torch.exp(torch.empty(nb, HV).uniform_(-3, 1, generator=g))
        beta = torch.rand(nb, HV, generator=g)
        conv_f, state_f = cl.decode(conv_q), sl.decode(state_q)

        # the torch reference: decode, the float decode, encode
        ref_conv, ref_state = conv_f.clone(), state_f.clone()
        x = conv1d_update_ref(mixed, ref_conv, weight.squeeze(1), None, slots, "silu")
        q, k, v = x.split([key_dim, key_dim, HV * dv], 1)
        want = gdn_state_update_ref(ref_state, q.reshape(nb, Hk, dk), k.reshape(nb, Hk, dk),
                                    v.reshape(nb, HV, dv), gate, beta, slots)

        # the float path of the CPU ops (C kernels) on the decoded slots: the same values
        float_conv, float_state = conv_f.clone(), state_f.clone()
        x = ops.conv1d_update(mixed, float_conv, weight.squeeze(1), None, slots)
        q, k, v = x.split([key_dim, key_dim, HV * dv], 1)
        same = ops.gdn_state_update(float_state, q.reshape(nb, Hk, dk), k.reshape(nb, Hk, dk),
                                    v.reshape(nb, HV, dv), gate, beta, slots)
        want_conv, want_state = conv_q.clone(), state_q.clone()
        want_conv[written] = cl.encode(float_conv[written])
        want_state[written] = sl.encode(float_state[written])

        got = ops.gdn_decode_q(mixed, gate, beta, slots, conv_pool=conv_q, conv_layout=cl, state_pool=state_q,
                               state_layout=sl, conv_weight=weight, num_k_heads=Hk, head_k_dim=dk,
                               num_v_heads=HV, head_v_dim=dv)
        assert got is not None
        assert nan_equal(got, same)  # value for value
        finite = ~want.isnan().flatten(1).any(1)
        assert torch.equal(finite, ~got.isnan().flatten(1).any(1)) and not finite[2]  # slot 5's request: NaN
        assert rel_err(got[finite], want[finite]) < 1e-5
        assert torch.equal(conv_q, want_conv)
        ok = torch.tensor([s != 5 for s in range(SLOTS)])  # slot 5's NaN row: codes differ, values do not
        assert torch.equal(state_q[ok], want_state[ok])
        assert nan_equal(sl.decode(state_q[5]), sl.decode(want_state[5]))
        kept = ok.clone()
        kept[0] = False  # (the reference steps the null slot too)
        assert rel_err(sl.decode(state_q[kept]), ref_state[kept]) < (0.02 if dtype == "int8" else 0.1)


def test_it_writes_nothing_where_it_cannot_run():
    """Repeated slots, a slot outside the pool, a float pool, other shapes or native kernels off:
    None, and the pools are untouched."""
    g, cl, sl, conv_q, state_q, weight = case("int8", 2, 16, 4, 16, seed=3)
    before = (conv_q.clone(), state_q.clone())
    conv_dim = 2 * 32 + 64
    kw = dict(conv_layout=cl, state_layout=sl, conv_weight=weight, num_k_heads=2, head_k_dim=16, num_v_heads=4,
              head_v_dim=16)
    mixed, gate, beta = torch.randn(2, conv_dim), -torch.rand(2, 4), torch.rand(2, 4)

    def call(slots, conv_pool=conv_q, **over):
        args = {**kw, **over}
        return ops.gdn_decode_q(mixed, gate, beta, torch.tensor(slots, dtype=torch.int32), conv_pool=conv_pool,
                                state_pool=state_q, **args)
    assert call([3, 3]) is None
    assert call([3, SLOTS]) is None
    assert call([3, 4], conv_pool=conv_q.float()) is None
    assert call([3, 4], head_v_dim=8) is None
    with native_cpu.forced_off():
        assert call([3, 4]) is None
    assert torch.equal(conv_q, before[0]) and torch.equal(state_q, before[1])
    assert call([3, 4]) is not None
    assert not torch.equal(state_q, before[1]) and not torch.equal(conv_q, before[0])
