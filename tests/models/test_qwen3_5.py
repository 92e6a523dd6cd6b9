"""Qwen3.5 / Qwen3.5-MoE's own checks (layout, projection and router names, published multimodal
checkpoints); the shared ones are their rows in test_families.py."""
import pytest
import torch
from safetensors.torch import load_file

from family_checks import BS, check_prompt_logits
from hybridkv.config_specs import load_specs
from hybridkv.models import load_model
from hybridkv.models.mlp import GatedMLP
from hybridkv.models.registry import family_module
from hybridkv.models.moe import SparseMoE
from hybridkv.specs import AttentionSpec, RecurrentSpec


def test_layout_split_projections_and_cache_specs(family_models):
    _, dense, _ = family_models("qwen3_5")
    _, moe, hf = family_models("qwen3_5_moe")
    assert [layer.is_attention for layer in dense.model.layers] == [False, True, False, True]
    assert all(type(layer.mlp) is GatedMLP for layer in dense.model.layers)
    assert all(isinstance(layer.mlp, SparseMoE) and layer.mlp.shared_expert is not None
               for layer in moe.model.layers)
    gdn = dict(dense.model.layers[0].linear_attn.named_parameters())
    assert {"in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"} <= set(gdn)
    assert not any(n.startswith(("in_proj_qkvz", "in_proj_ba")) for n in gdn)
    # GDN: conv over q, k, v = [2 * 2*16 + 4*16, 3]; state [v_heads, dk, dv]
    for model in (dense, moe):
        specs = model.cache_specs()
        assert specs[0] == specs[2] == RecurrentSpec((128, 3), (4, 16, 16), torch.float32)
        assert specs[1] == specs[3] == AttentionSpec(2, 16, torch.float32)
    torch.testing.assert_close(moe.model.layers[0].linear_attn.in_proj_z.weight,
                               hf.model.layers[0].linear_attn.in_proj_z.weight, rtol=0, atol=0)
    torch.testing.assert_close(moe.model.layers[1].mlp.router.weight,
                               hf.model.layers[1].mlp.gate.weight, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_published_multimodal_checkpoint_serves_its_text_model(family, tmp_path):
    """A `...ForConditionalGeneration` checkpoint (text config nested, text weights under
    `model.language_model.`, a vision tower) loads as the text model, with the logits of
    transformers' AutoModelForCausalLM of the same directory; the config-only plan is the model's."""
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    text = family_module(family).tiny_config().to_dict()
    text.pop("architectures")
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
    arch = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[family]
    config = CONFIG_MAPPING[family](text_config=text, vision_config=vision, architectures=[arch])
    torch.manual_seed(4)
    vl = getattr(transformers, arch)(config)
    with torch.no_grad():
        for p in vl.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    vl.save_pretrained(str(tmp_path))
    assert any(k.startswith("model.language_model.") for k in load_file(str(tmp_path / "model.safetensors")))

    ours = load_model(tmp_path)
    assert ours.architecture == family_module(family).ARCHITECTURE
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    check_prompt_logits(ours, hf, n=BS + 5)
    assert load_specs(tmp_path / "config.json", torch.float32) == ours.cache_specs()
