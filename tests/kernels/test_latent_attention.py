"""Multi-head latent attention over latent pages: the torch reference against transformers'
KimiLinearAttention (which caches the same latents and expands them per head)."""
import pytest
import torch
from transformers import KimiLinearConfig
from transformers.models.kimi_linear import modeling_kimi_linear as kl

from hybridkv.kernels.latent_attention_ref import latent_paged_attention_ref, write_latent_ref
from state_kernel_helpers import rel_err

HEADS, RANK, NOPE, ROPE, V, HIDDEN, BS = 4, 24, 12, 8, 10, 32, 4


def _hf(gen):
    cfg = KimiLinearConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                           kv_lora_rank=RANK, q_lora_rank=None, qk_nope_head_dim=NOPE,
                           qk_rope_head_dim=ROPE, v_head_dim=V, num_hidden_layers=2)
    cfg._attn_implementation = "eager"
    m = kl.KimiLinearAttention(cfg, 1).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 1.0))
    return m


def _latents_and_q(m, hidden):
    c, k_rot = m.kv_a_proj_with_mqa(hidden).split([RANK, ROPE], dim=-1)
    latent = torch.cat([m.kv_a_layernorm(c), k_rot], dim=-1)
    return latent, m.q_proj(hidden).view(hidden.shape[0], HEADS, NOPE + ROPE)


@torch.no_grad()
def test_chunks_over_shuffled_pages_match_transformers():
    """Two requests prefilled in uneven chunks (one a single decode token) through shuffled latent
    pages equal transformers' attention of each whole prompt at once."""
    gen = torch.Generator().manual_seed(0)
    m = _hf(gen)
    lengths, chunks = [11, 7], [[5, 1, 5], [4, 3]]
    hidden = [torch.randn(n, HIDDEN, generator=gen) for n in lengths]
    mask = [torch.full((n, n), float("-inf")).triu(1)[None, None] for n in lengths]
    want = [m(h[None], mask[r])[0][0] for r, h in enumerate(hidden)]
    pages = torch.randn(16, 1, BS, 1, RANK + ROPE, generator=gen)  # garbage never read
    order = torch.randperm(16, generator=gen).tolist()
    tables = [order[:3], order[3:5]]
    done, got = [0, 0], [[], []]
    for step in range(3):
        rows = [r for r in range(2) if step < len(chunks[r])]
        qs, slots, qsl, lens = [], [], [0], []
        for r in rows:
            a, n = done[r], chunks[r][step]
            latent, q = _latents_and_q(m, hidden[r][a:a + n])
            write_latent_ref(latent, pages, torch.tensor([tables[r][p // BS] * BS + p % BS
                                                          for p in range(a, a + n)]))
            qs.append(q)
            qsl.append(qsl[-1] + n)
            done[r] += n
            lens.append(done[r])
        table = torch.tensor([tables[r] + [0] * (3 - len(tables[r])) for r in rows], dtype=torch.int32)
        o = latent_paged_attention_ref(torch.cat(qs), pages, m.kv_b_proj.weight,
                                       torch.tensor(qsl, dtype=torch.int32),
                                       torch.tensor(lens, dtype=torch.int32), table,
                                       m.scaling, NOPE, V)
        for j, r in enumerate(rows):
            got[r].append(m.o_proj(o[qsl[j]:qsl[j + 1]].reshape(-1, HEADS * V)))
    for r in range(2):
        assert rel_err(torch.cat(got[r]), want[r]) < 1e-5


def test_bad_pages_and_weights_are_refused():
    gen = torch.Generator().manual_seed(1)
    pages = torch.randn(4, 1, BS, 1, RANK + ROPE, generator=gen)
    before = pages.clone()
    with pytest.raises(ValueError, match=r"latent \(2, 31\) does not fit latent pages"):
        write_latent_ref(torch.randn(2, RANK + ROPE - 1), pages, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="slot 16 is outside the 16 slots"):
        write_latent_ref(torch.randn(2, RANK + ROPE), pages, torch.tensor([0, 16]))
    q = torch.randn(2, HEADS, NOPE + ROPE)
    with pytest.raises(ValueError, match="kv_b_weight"):
        latent_paged_attention_ref(q, pages, torch.randn(HEADS * (NOPE + V), RANK + 1),
                                   torch.tensor([0, 2]), torch.tensor([2]), torch.tensor([[0]]),
                                   0.1, NOPE, V)
    assert torch.equal(pages, before)
