"""Zamba2's own checks (cache keys per attention site, shared block weights, checkpoints that
repeat a shared block); the shared ones are its row in test_families.py."""
import shutil

import torch
from safetensors.torch import load_file, save_file

from family_checks import BS, prompt
from hybridkv.models import load_model
from hybridkv.models.zamba2 import Zamba2HybridLayer
from hybridkv.specs import AttentionSpec, RecurrentSpec
from model_harness import Harness

N_LAYERS = 6
HYBRID = (1, 3, 4)  # tiny_config: sites 0 and 2 (layers 1, 4) share block 0; site 1 runs block 1


def test_cache_specs_key_every_mamba_layer_and_every_attention_site(family_models):
    _, ours, _ = family_models("zamba2")
    specs = ours.cache_specs()
    # key i: layer i's Mamba2 state; key num_layers + i: the KV of hybrid layer i's use site
    assert sorted(specs) == list(range(N_LAYERS)) + [N_LAYERS + i for i in HYBRID]
    # conv [d_inner + 2 * groups * d_state, k - 1]; state [heads, head_dim, d_state]
    mamba = RecurrentSpec((64 + 2 * 2 * 16, 3), (4, 16, 16), torch.float32)
    assert all(specs[i] == mamba for i in range(N_LAYERS))
    # head_dim = 2 * hidden / heads: the block attends over [hidden | embeddings]
    assert all(specs[N_LAYERS + i] == AttentionSpec(4, 16, torch.float32) for i in HYBRID)


def test_sites_share_block_weights_but_not_adapters(family_models):
    _, ours, hf = family_models("zamba2")
    site0, site1, site2 = (ours.model.layers[i] for i in HYBRID)
    assert all(isinstance(s, Zamba2HybridLayer) for s in (site0, site1, site2))
    assert site0.shared_transformer is site2.shared_transformer
    assert site0.shared_transformer is not site1.shared_transformer
    attn = site0.shared_transformer.self_attn
    assert not torch.equal(attn.linear_q_adapter_list[0][1].weight, attn.linear_q_adapter_list[2][1].weight)
    assert not torch.equal(site0.linear.weight, site2.linear.weight)
    # every tensor equals transformers' under the same name (its tied copies included)
    ref = hf.state_dict()
    for name, t in ours.state_dict().items():
        torch.testing.assert_close(t, ref[name], rtol=0, atol=0, msg=name)


def test_checkpoint_with_every_sites_copy_loads_the_same(family_models, tmp_path):
    # save_pretrained stores a block once, under its first site; transformers' in-memory state dict
    # repeats it under every site (as a checkpoint saved without dedup would): both load the same
    ckpt, ours, hf = family_models("zamba2")
    assert "model.layers.1.shared_transformer.self_attn.q_proj.weight" in load_file(str(ckpt / "model.safetensors"))
    assert "model.layers.4.shared_transformer.self_attn.q_proj.weight" not in load_file(str(ckpt / "model.safetensors"))
    shutil.copytree(ckpt, tmp_path / "ckpt")
    state = {k: v.clone() for k, v in hf.state_dict().items()}  # clones: safetensors refuses aliases
    assert "model.layers.4.shared_transformer.self_attn.q_proj.weight" in state
    save_file(state, str(tmp_path / "ckpt" / "model.safetensors"), metadata={"format": "pt"})
    again = load_model(tmp_path / "ckpt")
    tokens = prompt(BS + 3, 9)
    a, b = Harness(ours), Harness(again)
    torch.testing.assert_close(a.step([(a.add(tokens), len(tokens))], return_all_logits=True),
                               b.step([(b.add(tokens), len(tokens))], return_all_logits=True),
                               rtol=0, atol=0)
