"""write_latent_triton (interpreted) against a per-token loop: -1 rows skipped, a strided latent,
no host sync; bad inputs refused before anything is written."""
import pytest
import torch

import hybridkv.kernels as K
from hybridkv.kernels.latent_write_kernel import write_latent_triton
from hybridkv.scheduler.host_sync_check import NoHostSync

BS, DIM = 4, 40  # DIM not a power of two: the kernel's last tile is masked


def loop_oracle(latent, cache, slots):
    out = cache.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            out[s // BS, 0, s % BS, 0] = latent[t].to(cache.dtype)
    return out


@pytest.mark.slow  # interpreted Triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_loop_and_skips_padding(dtype):
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(6, 1, BS, 1, DIM, generator=g).to(dtype)
    latent = torch.randn(9, 2 * DIM, generator=g).to(dtype)[:, :DIM]  # strided rows, the pages' dtype
    slots = torch.randperm(6 * BS, generator=g)[:9].long()
    slots[::4] = -1
    want = loop_oracle(latent, cache, slots)
    with NoHostSync():
        write_latent_triton(latent, cache, slots)
    assert torch.equal(cache, want)


@pytest.mark.slow  # interpreted Triton
def test_dispatch_picks_the_kernel_on_the_triton_backend(monkeypatch):
    g = torch.Generator().manual_seed(4)
    cache = torch.randn(3, 1, BS, 1, DIM, generator=g)
    latent = torch.randn(2, DIM, generator=g)
    slots = torch.tensor([5, -1])
    want = loop_oracle(latent, cache, slots)
    monkeypatch.setenv("HYBRIDKV_BACKEND", "triton")
    with NoHostSync():  # the reference's boolean mask would be refused here
        K.write_latent(latent, cache, slots)
    assert torch.equal(cache, want)


def test_bad_inputs_are_refused_and_write_nothing():
    cache = torch.randn(3, 1, BS, 1, DIM)
    before = cache.clone()
    with pytest.raises(ValueError, match=r"latent \(2, 39\) does not fit latent pages \(3, 1, 4, 1, 40\)"):
        write_latent_triton(torch.randn(2, DIM - 1), cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"slot_mapping \(3,\) must hold one slot per latent row \(2\)"):
        write_latent_triton(torch.randn(2, DIM), cache, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="does not fit latent pages"):
        write_latent_triton(torch.randn(2, DIM), torch.randn(3, 2, BS, 1, DIM), torch.tensor([0, 1]))
    assert torch.equal(cache, before)
