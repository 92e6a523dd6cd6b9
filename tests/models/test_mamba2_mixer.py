"""Mamba2Mixer's decode in one C call (kernels/mamba2_native.py) against the same mixer with native
kernels forced off (the torch kernels, each checked against its reference in tests/kernels), over a
prefill, decode-only steps and a mixed step, for the norm variants of the Mamba2 families."""
import pytest
import torch

from hybridkv.kernels import native_cpu
from hybridkv.kernels.mamba2_native import Mamba2MixerDecode
from hybridkv.models.forward_batch import ForwardBatch
from hybridkv.models.mamba2_mixer import Mamba2Mixer

SLOTS = 8


def batch(qlens, slens, slots):
    T = sum(qlens)
    return ForwardBatch(
        input_ids=torch.zeros(T, dtype=torch.long), positions=torch.zeros(T, dtype=torch.long),
        query_start_loc=torch.tensor([0] + qlens).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor(slens, dtype=torch.int32),
        block_table=torch.zeros(len(qlens), 1, dtype=torch.int32),
        slot_mapping=torch.full((T,), -1), state_slots=torch.tensor(slots, dtype=torch.int32),
        has_initial_state=torch.tensor([s > q for q, s in zip(qlens, slens)]),
        query_lens_cpu=list(qlens), seq_lens_cpu=list(slens))


def random_mixer(seed, **kw):
    torch.manual_seed(seed)
    mixer = Mamba2Mixer(32, num_heads=4, head_dim=8, d_state=6, d_conv=4, chunk_size=4, eps=1e-5, **kw).eval()
    with torch.no_grad():  # the defaults (ones, zeros) would hide a swapped or missing parameter
        for p in (mixer.dt_bias, mixer.A_log, mixer.D, mixer.conv1d.bias):
            p.normal_(0, 0.5)
        if mixer.norm is not None:
            mixer.norm.weight.normal_(1, 0.3)
    return mixer


@pytest.mark.parametrize("kw", [dict(n_groups=1), dict(n_groups=2),
                                dict(n_groups=2, norm_before_gate=True),
                                dict(n_groups=1, gated_norm=False,
                                     zxbcdt_multipliers=[0.5, 1.5, 1.0, 0.7, 2.0])],
                         ids=["groups1", "groups2", "norm_before_gate", "no_norm_mup"])
def test_native_decode_matches_torch_path(kw, monkeypatch):
    if native_cpu.library("mamba2_decode") is None:
        pytest.fail("kernels/native/mamba2_decode.c must build on these machines")
    ran, built = [], []
    native, build = Mamba2MixerDecode.__call__, Mamba2MixerDecode.__init__
    monkeypatch.setattr(Mamba2MixerDecode, "__call__", lambda *a: ran.append(native(*a)) or ran[-1])
    monkeypatch.setattr(Mamba2MixerDecode, "__init__", lambda *a: built.append(1) or build(*a))
    mixer = random_mixer(3, **kw)
    pools = {}
    for name in ("native", "torch"):
        g = torch.Generator().manual_seed(0)
        pools[name] = (torch.randn(SLOTS, mixer.conv_dim, 3, generator=g),
                       torch.randn(SLOTS, 4, 8, 6, generator=g))
    slots = [5, 2, 7]
    steps = [([6, 3, 9], [6, 3, 9])]  # prompts, then decodes (the slots out of order), then a mixed step
    steps += [([1, 1, 1], [6 + i, 3 + i, 9 + i]) for i in range(1, 4)]
    steps += [([1, 4, 1], [10, 4, 13])]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for qlens, slens in steps:
            b = batch(qlens, slens, slots)
            hidden = torch.randn(sum(qlens), 32, generator=g)
            got = mixer(hidden, b, *pools["native"])
            with native_cpu.forced_off():
                want = mixer(hidden, b, *pools["torch"])
            assert (got - want).abs().max() <= 1e-5 * want.abs().max()
            for a, w in zip(pools["native"], pools["torch"]):
                assert (a - w).abs().max() <= 1e-5 * w.abs().max()
    assert len(ran) == 3 and all(y is not None for y in ran)  # the three decode-only steps ran in C
    assert len(built) == 1  # its arguments were set up once for these pools and weights


@pytest.mark.slow  # interpreted Triton
@pytest.mark.parametrize("cache", ["int8", "fp8_e4m3"])
def test_decode_over_codes_takes_the_triton_column_as_the_c_one(cache, monkeypatch):
    """Mamba2Mixer.forward_codes on the op's CUDA column (HYBRIDKV_BACKEND=triton: the Triton kernels,
    interpreted) writes the conv windows' bytes the C column writes, the states' codes within one step
    of its (another order of float operations), and returns its output within fp32 rounding."""
    from hybridkv.cache_dtype import conv_layout, state_layout
    from hybridkv.models.forward_batch import QuantizedState

    mixer = random_mixer(5, n_groups=2)
    cl, sl = conv_layout(cache, (mixer.conv_dim, 3)), state_layout(cache, (4, 8, 6))
    g = torch.Generator().manual_seed(2)
    conv_q = cl.encode(torch.randn(SLOTS, mixer.conv_dim, 3, generator=g))
    ssm_q = sl.encode(torch.randn(SLOTS, 4, 8, 6, generator=g) * torch.exp(torch.randn(SLOTS, 4, 8, 1, generator=g)))
    hidden = torch.randn(3, 32, generator=g)
    slots = [5, 2, 7]
    got = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("HYBRIDKV_BACKEND", backend)
        conv, state = conv_q.clone(), ssm_q.clone()
        with torch.no_grad():
            y = mixer.forward_codes(hidden, batch([1, 1, 1], [4, 9, 2], slots),
                                    QuantizedState(conv, cl, state, sl, torch.tensor(slots, dtype=torch.int32)))
        assert y is not None
        got[backend] = (y, conv, state)
    (y_t, conv_t, state_t), (y_c, conv_c, state_c) = got["triton"], got["torch"]
    torch.testing.assert_close(y_t, y_c, rtol=1e-5, atol=1e-5)
    assert torch.equal(conv_t, conv_c) and not torch.equal(conv_c, conv_q)
    assert torch.equal(state_t[:, sl.numel:][[0, 1, 3, 4, 6]], ssm_q[:, sl.numel:][[0, 1, 3, 4, 6]])  # untouched slots
    codes = (lambda raw: raw[:, :sl.numel].view(torch.int8).int()) if cache == "int8" else \
        (lambda raw: torch.where(raw[:, :sl.numel].int() >= 128, 128 - raw[:, :sl.numel].int(), raw[:, :sl.numel].int()))
    assert int((codes(state_t) - codes(state_c)).abs().max()) <= 1
