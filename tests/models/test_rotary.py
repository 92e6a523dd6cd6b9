"""models/rotary.py: the step's (cos, sin) tables and apply_rotary against transformers' rotary
(Llama default rope, Llama-3 scaling, Bamba's partial rotary), on random positions and inputs."""
import pytest
import torch

from hybridkv.models.rotary import RotaryEmbedding, apply_rotary


def _cases():
    from transformers import BambaConfig, LlamaConfig
    from transformers.models.bamba.modeling_bamba import BambaRotaryEmbedding
    from transformers.models.bamba.modeling_bamba import apply_rotary_pos_emb as bamba_apply
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_apply

    llama = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64)
    llama3 = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512})
    bamba = BambaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    return {"llama": (llama, LlamaRotaryEmbedding, llama_apply, 64),
            "llama3": (llama3, LlamaRotaryEmbedding, llama_apply, 64),
            "bamba_partial": (bamba, BambaRotaryEmbedding, bamba_apply, 64)}


@pytest.mark.parametrize("name", ["llama", "llama3", "bamba_partial"])
def test_tables_and_rotation_match_transformers(name):
    config, hf_rope_cls, hf_apply, head_dim = _cases()[name]
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 4000, (23,), generator=g)
    cos, sin = RotaryEmbedding(config, head_dim)(pos)
    hf_cos, hf_sin = hf_rope_cls(config)(torch.zeros(1, 23, 8), pos[None])
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])  # same ops: bit-exact
    q, k = torch.randn(23, 4, head_dim, generator=g), torch.randn(23, 2, head_dim, generator=g)
    hq, hk = hf_apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    torch.testing.assert_close(apply_rotary(q, cos, sin), hq[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(apply_rotary(k, cos, sin), hk[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
