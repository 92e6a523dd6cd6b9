"""Tiny random checkpoints (config + safetensors + a local tokenizer) for tests and examples."""
from __future__ import annotations

from pathlib import Path

import torch

from .registry import family_module

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")  # ids 0..3, matching tiny_config's ids


def make_tiny_tokenizer(path: str | Path, vocab_size: int):
    """Save a character-level PreTrainedTokenizerFast (specials, newline, printable ASCII: 100 ids) to `path`.

    Built offline with `tokenizers`: every printable character is one token; decode joins them.
    Raises ValueError when the 99 ids do not fit `vocab_size`.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = list(SPECIAL_TOKENS) + ["\n"] + [chr(c) for c in range(32, 127)]
    if len(tokens) > vocab_size:
        raise ValueError(f"the tiny tokenizer needs {len(tokens)} ids; the config's vocab_size is "
                         f"{vocab_size}; pass vocab_size >= {len(tokens)}")
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(str(path))
    return fast


def make_tiny_checkpoint(family: str, path: str | Path, seed: int = 0, **config_overrides) -> Path:
    """Write a random `family` checkpoint ("llama", "bamba", ... or an architecture name) to `path`.

    The config is the family's `tiny_config(**config_overrides)`; weights come from transformers'
    own initialisation under `torch.manual_seed(seed)`, then every 1-D parameter (norm weights,
    biases, A_log, D, dt_bias...) gets N(0, 0.1) noise so no weight is trivially 1 or 0.
    Returns the directory (config.json, model.safetensors, generation_config.json, tokenizer).
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = family_module(family).tiny_config(**config_overrides)
    torch.manual_seed(seed)
    # a multimodal family with no ForCausalLM class (GLM-5-Next) is saved as its whole model
    auto = AutoModelForCausalLM if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else AutoModelForImageTextToText
    hf = auto.from_config(config)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(str(path))
    make_tiny_tokenizer(path, config.get_text_config().vocab_size)
    return path


def add_tiny_mtp_weights(path: str | Path, seed: int = 0, scale: float = 0.1) -> Path:
    """Give a tiny Qwen3-Next checkpoint (make_tiny_checkpoint("qwen3_next", path)) random MTP weights
    in the published layout (`mtp.*`, which transformers neither makes nor reads): `mtp.layers.0.*`
    shaped as the checkpoint's first full-attention layer (its MLP of the kind layer 0's rule gives:
    a sparse MoE in tiny_config), `mtp.fc.weight` [H, 2H] and the three norms; N(0, scale) values
    from `seed`. Rewrites model.safetensors; returns `path`."""
    import json

    from safetensors.torch import load_file, save_file

    path = Path(path)
    tensors = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    layer_types = json.loads((path / "config.json").read_text())["layer_types"]
    template = f"model.layers.{layer_types.index('full_attention')}."
    new = {"mtp.layers.0." + k[len(template):]: v for k, v in tensors.items() if k.startswith(template)}
    new.update({"mtp.fc.weight": torch.empty(hidden, 2 * hidden), "mtp.norm.weight": torch.empty(hidden),
                "mtp.pre_fc_norm_embedding.weight": torch.empty(hidden),
                "mtp.pre_fc_norm_hidden.weight": torch.empty(hidden)})
    for k, v in new.items():
        tensors[k] = (torch.randn(v.shape, generator=gen) * scale).to(v.dtype)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
