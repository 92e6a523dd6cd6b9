"""latent_decode_attention (one query per request, absorbed into the latent space, chunked
online softmax) against latent_paged_attention_ref (itself checked against transformers'
KimiLinearAttention in test_latent_attention.py), on random pages and shuffled tables with
garbage past each request's blocks; no host sync; the dispatch picks it only for decode steps
on the Triton backend."""
import pytest
import torch

import hybridkv.kernels as K
from hybridkv.kernels.latent_attention_decode import latent_decode_attention
from hybridkv.kernels.latent_attention_ref import latent_paged_attention_ref
from hybridkv.scheduler.host_sync_check import HostSyncError, NoHostSync

HEADS, RANK, NOPE, ROPE, V, BS, WIDTH = 4, 24, 12, 8, 10, 4, 5
LENS = [1, BS, BS + 1, 3 * BS - 1, WIDTH * BS]  # one key, a block edge, past it, a full table


def make_inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    pages = torch.randn(32, 1, BS, 1, RANK + ROPE, generator=g).to(dtype)
    q = torch.randn(len(LENS), HEADS, NOPE + ROPE, generator=g).to(dtype)
    w = (torch.randn(HEADS * (NOPE + V), RANK, generator=g) * 0.3).to(dtype)
    order = torch.randperm(31, generator=g) + 1
    table = order[:len(LENS) * WIDTH].view(len(LENS), WIDTH).to(torch.int32)
    for r, n in enumerate(LENS):  # entries past a request's blocks: -1 or stale ids
        table[r, -(-n // BS):] = torch.tensor([-1, 7, 0, 30, -1])[:WIDTH - (-(-n // BS))]
    return q, pages, w, torch.tensor(LENS, dtype=torch.int32), table


def reference(q, pages, w, lens, table, scale):
    qsl = torch.arange(len(LENS) + 1, dtype=torch.int32)
    return latent_paged_attention_ref(q, pages, w, qsl, lens, table.clamp(min=0), scale, NOPE, V)


@pytest.mark.parametrize("chunk", [1, 2, 64])
def test_matches_reference_over_chunked_tables(chunk):
    q, pages, w, lens, table = make_inputs(torch.float32, seed=chunk)
    scale = (NOPE + ROPE) ** -0.5
    want = reference(q, pages, w, lens, table, scale)
    with NoHostSync():
        got = latent_decode_attention(q, pages, w, lens, table, scale, NOPE, V, blocks_per_chunk=chunk)
    assert got.shape == (len(LENS), HEADS, V)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert want.abs().max() > 0.1  # a real signal, not zeros


def test_bf16_matches_reference():
    q, pages, w, lens, table = make_inputs(torch.bfloat16, seed=5)
    want = reference(q, pages, w, lens, table, 0.3)
    got = latent_decode_attention(q, pages, w, lens, table, 0.3, NOPE, V, blocks_per_chunk=2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_dispatch_takes_it_for_decode_steps_on_the_triton_backend(monkeypatch):
    q, pages, w, lens, table = make_inputs(torch.float32, seed=7)
    qsl = torch.arange(len(LENS) + 1, dtype=torch.int32)
    table = table.clamp(min=0)
    want = latent_paged_attention_ref(q, pages, w, qsl, lens, table, 0.3, NOPE, V)
    monkeypatch.setenv("HYBRIDKV_BACKEND", "triton")
    with NoHostSync():
        got = K.latent_paged_attention(q, pages, w, qsl, lens, table, 0.3, NOPE, V, max_query_len=1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(HostSyncError), NoHostSync():  # a prefill (or unknown) step: the reference
        K.latent_paged_attention(q, pages, w, qsl, lens, table, 0.3, NOPE, V, max_query_len=None)


def test_bad_inputs_are_refused():
    q, pages, w, lens, table = make_inputs(torch.float32)
    with pytest.raises(ValueError, match=r"kv_b_weight \(88, 23\) does not fit 4 heads of "
                                         r"12\+10 dims from a latent of 24"):
        latent_decode_attention(q, pages, w[:, :-1], lens, table, 0.3, NOPE, V)
    with pytest.raises(ValueError, match=r"needs seq_lens \[5\] and block_table \[5, W\]; got \(4,\)"):
        latent_decode_attention(q, pages, w, lens[:4], table, 0.3, NOPE, V)
    with pytest.raises(ValueError, match="blocks_per_chunk=0 must be >= 1"):
        latent_decode_attention(q, pages, w, lens, table, 0.3, NOPE, V, blocks_per_chunk=0)
