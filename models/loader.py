"""Load a Hugging Face checkpoint directory into the family's HybridModel."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from .base import HybridModel
from .checkpoint import CheckpointError, CheckpointTensors
from .registry import family_module, supported_architectures

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_config(path: str | Path):
    """config.json -> the transformers config class of its model_type (no remote code)."""
    from transformers import AutoConfig

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist; pass the folder "
                                f"that holds config.json and the *.safetensors weights")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json; it is not a Hugging Face checkpoint "
                                f"directory (save one with model.save_pretrained(dir))")
    try:
        return AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except ValueError as e:
        raise CheckpointError(f"cannot read {path / 'config.json'}: {e}; supported architectures: "
                              f"{', '.join(supported_architectures())}") from e


def fingerprint(path: Path, ckpt: CheckpointTensors, dtype: torch.dtype) -> str:
    """sha256 of the canonical config.json, the weights' checksum and the compute dtype.

    Anything that changes KV or state values changes it, so prefix caches keyed by it never mix.
    """
    cfg = json.dumps(json.loads((path / "config.json").read_text()), sort_keys=True)
    h = hashlib.sha256()
    for part in (cfg, ckpt.checksum(), str(dtype)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _eos_ids(path: Path, config, tokenizer) -> list[int]:
    ids: list[int] = []
    gen = path / "generation_config.json"
    sources = [json.loads(gen.read_text()).get("eos_token_id")] if gen.is_file() else []
    sources.append(getattr(config, "eos_token_id", None))
    if tokenizer is not None:
        sources.append(tokenizer.eos_token_id)
    for s in sources:
        for i in (s if isinstance(s, (list, tuple)) else [s]):
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids


def load_tokenizer(path: Path):
    """The directory's tokenizer through transformers, or None when it ships none."""
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)


def build_model(config, device="cpu", dtype=torch.float32) -> HybridModel:
    """The family's model for `config`, parameters allocated but NOT initialised (meta -> device).

    Family modules must not compute non-parameter tensors on the default device in __init__
    (it is `meta` here): use an explicit device="cpu" and move lazily, as rotary.py does.
    """
    arch = (getattr(config, "architectures", None) or [None])[0]
    module = family_module(arch)
    with torch.device("meta"):
        model = module.MODEL_CLASS(config)
    model = model.to(dtype=dtype).to_empty(device=torch.device(device))
    model.architecture = module.ARCHITECTURE
    return model


def load_model(path: str | Path, device="cpu", dtype: torch.dtype = torch.float32) -> HybridModel:
    """Checkpoint directory -> HybridModel in eval mode on `device` with parameters in `dtype`.

    Raises FileNotFoundError (no directory / config.json), UnsupportedArchitectureError (listing
    the supported ones) and CheckpointError (no weights, a tensor missing or of the wrong shape).
    """
    path = Path(path)
    config = load_config(path)
    arch = (getattr(config, "architectures", None) or [None])[0]
    family_module(arch)  # fail on the architecture before reading any weights
    ckpt = CheckpointTensors(path)
    model = build_model(config, device=device, dtype=dtype)
    model.load_weights(ckpt)
    model.tokenizer = load_tokenizer(path)
    model.eos_token_ids = _eos_ids(path, config, model.tokenizer)
    model.fingerprint = fingerprint(path, ckpt, dtype)
    return model.eval()
