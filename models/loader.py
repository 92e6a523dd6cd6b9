"""Load a Hugging Face checkpoint directory into the family's HybridModel."""
from __future__ import annotations

import hashlib
import importlib.resources
import json
import logging
import os
import re
from pathlib import Path
from typing import Optional, Union

import torch

from .base import HybridModel
from .checkpoint import CheckpointError, CheckpointTensors, read_json
from .config_check import check_config
from .generation_defaults import GenerationDefaults, read_generation_defaults
from .registry import family_module, supported_architectures

log = logging.getLogger(__name__)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16}
DType = Union[torch.dtype, str]  # a torch dtype, a name in DTYPES, or "auto"
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # "org/name" (or a legacy "name") on the hub


def parse_dtype(d: DType) -> DType:
    """A dtype option -> a torch.dtype, or "auto" (resolved from config.json by `load_model`).
    ValueError naming the value and the accepted names otherwise."""
    if isinstance(d, torch.dtype) or d == "auto":
        return d
    if not isinstance(d, str) or d not in DTYPES:
        raise ValueError(f"dtype={d!r}; choose 'auto' (the checkpoint's dtype in config.json) or one "
                         f"of {sorted(DTYPES)}")
    return DTYPES[d]


def checkpoint_dtype(config: dict, file: Path) -> torch.dtype:
    """The dtype config.json says the weights were saved in (`dtype`, or transformers 4's
    `torch_dtype`, also under `text_config`); float32 when it names none."""
    for section in (config, config.get("text_config") or {}):
        name = section.get("dtype") or section.get("torch_dtype")
        if name is not None:
            key = str(name).removeprefix("torch.")
            if key not in DTYPES:
                raise CheckpointError(f"{file} names dtype {name!r}, which this engine cannot compute "
                                      f"in; pass dtype= one of {sorted(DTYPES)}")
            return DTYPES[key]
    return torch.float32


def load_config(path: str | Path):
    """config.json -> (the transformers config class of its model_type (no remote code), the raw
    JSON dict). Raises FileNotFoundError, or CheckpointError naming config.json and what is wrong."""
    from transformers import AutoConfig

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist; pass the folder "
                                f"that holds config.json and the *.safetensors weights")
    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no config.json; it is not a Hugging Face checkpoint "
                                f"directory (save one with model.save_pretrained(dir))")
    raw = read_json(file)
    check_config(raw, file)  # before transformers divides by a head count
    try:
        return AutoConfig.from_pretrained(str(path), trust_remote_code=False), raw
    except ValueError as e:
        raise CheckpointError(f"cannot read {file}: {e}; supported architectures: "
                              f"{', '.join(supported_architectures())}") from e


def fingerprint(config: dict, ckpt: CheckpointTensors, dtype: torch.dtype) -> str:
    """sha256 of the canonical config.json, the weights' identity (safetensors headers, sizes and
    sampled bytes: `CheckpointTensors.identity`, which says what it misses) and the compute dtype.

    Prefix caches and migration are keyed by it: two copies of one checkpoint match, a different
    config, dtype, tensor layout or fine-tune does not. Reads ~0.5 MB per file, not the weights.
    """
    h = hashlib.sha256()
    for part in (json.dumps(config, sort_keys=True), ckpt.identity(), str(dtype)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def resolve_device(device) -> torch.device:
    """A device option -> torch.device: "auto" is cuda when torch sees a GPU, else cpu (logged)."""
    if device == "auto":
        chosen = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        log.info("device='auto': running on %s", chosen)
        return chosen
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r}; choose 'auto', 'cpu', 'cuda' or 'cuda:<index>'") from None


def _hub_cache() -> Path:
    """The Hugging Face hub cache, read from the environment now (not at import): HF_HUB_CACHE,
    else HF_HOME/hub, else huggingface_hub's default."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


BUILTIN_PREFIX = "hybridkv/"  # built-in names: hybridkv/<folder of hybridkv/builtin_models>


def builtin_models() -> dict[str, Path]:
    """Built-in name ("hybridkv/tiny-code") -> its checkpoint folder, shipped inside the package
    (hybridkv/builtin_models/<name>/, each with a config.json), sorted by name."""
    root = Path(str(importlib.resources.files("hybridkv"))) / "builtin_models"  # no import edge back
    found = sorted(p.parent for p in root.glob("*/config.json")) if root.is_dir() else []
    return {BUILTIN_PREFIX + p.name: p for p in found}


def resolve_checkpoint(model: str | Path) -> Path:
    """A built-in name ("hybridkv/tiny-code": `builtin_models`), a checkpoint directory, or a model
    id ("org/name") already in the local Hugging Face cache -> the directory to load. Never
    downloads (local_files_only). FileNotFoundError listing the built-in names for an unknown
    "hybridkv/..." name, or naming the id and the cache folder it looked in when nothing fits."""
    path = Path(model)
    if isinstance(model, str) and model.startswith(BUILTIN_PREFIX) and not path.is_dir():
        builtin = builtin_models()
        if model not in builtin:
            raise FileNotFoundError(
                f"{model!r} is not a built-in model; the built-in names are "
                f"{', '.join(builtin) or '(none: hybridkv/builtin_models is empty)'}; or pass a "
                f"checkpoint directory")
        return builtin[model]
    if path.is_dir() or isinstance(model, Path) or not _REPO_ID.fullmatch(str(model)):
        return path
    from huggingface_hub import snapshot_download

    cache = _hub_cache()
    try:
        found = Path(snapshot_download(repo_id=str(model), cache_dir=str(cache), local_files_only=True))
    except Exception as e:  # not cached (LocalEntryNotFoundError), or a malformed cache entry
        folder = cache / ("models--" + str(model).replace("/", "--"))
        raise FileNotFoundError(
            f"{str(model)!r} is neither a checkpoint directory nor a model id in the local Hugging Face "
            f"cache (looked in {folder}: {type(e).__name__}); hybridkv never downloads: fetch it "
            f"first (`hf download {model}`) or pass the folder that holds config.json") from None
    log.info("model id %r: loading the cached snapshot %s", str(model), found)
    return found


def _eos_ids(defaults: GenerationDefaults, config, tokenizer) -> list[int]:
    """generation_config.json's EOS ids, then config.json's, then the tokenizer's, without repeats."""
    ids: list[int] = list(dict.fromkeys(defaults.eos_token_ids))
    sources = [getattr(config, "eos_token_id", None)]
    if tokenizer is not None:
        sources.append(tokenizer.eos_token_id)
    for s in sources:
        for i in (s if isinstance(s, (list, tuple)) else [s]):
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids


def load_tokenizer(path: Path):
    """The directory's tokenizer through transformers, or None when it ships none. A tokenizer
    file that is not valid JSON raises CheckpointError naming it."""
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception:
        for name in ("tokenizer.json", "tokenizer_config.json"):  # parsed again only on failure
            if (path / name).is_file():
                read_json(path / name)
        raise


def build_model(config, device="cpu", dtype=torch.float32, cut=None, with_mtp: bool = False) -> HybridModel:
    """The family's model for `config`, parameters allocated but NOT initialised (meta -> device).

    Family modules must not compute non-parameter tensors on the default device in __init__
    (it is `meta` here): use an explicit device="cpu" and move lazily, as rotary.py does.
    `cut(model)`, when given, runs on the meta model before allocation (a tensor-parallel shard).
    with_mtp: build the checkpoint's multi-token-prediction head too (speculative method 'mtp').
    """
    arch = (getattr(config, "architectures", None) or [None])[0]
    module = family_module(arch)
    with torch.device("meta"):
        model = module.MODEL_CLASS(config, with_mtp=True) if with_mtp else module.MODEL_CLASS(config)
    model = model.to(dtype=dtype)
    model.architecture = module.ARCHITECTURE
    if cut is not None:
        cut(model)
    return model.to_empty(device=torch.device(device))


def check_mtp(arch: str, ckpt: CheckpointTensors, path: Path) -> None:
    """Refuse MTP drafting, by name, for a family without an MTP head or a checkpoint without its
    weights."""
    weights = getattr(family_module(arch).MODEL_CLASS, "mtp_weights", None)
    if weights is None:
        raise ValueError(f"speculative method 'mtp': {arch} has no multi-token-prediction head in this version "
                         f"(Qwen3-Next and Qwen3.5 checkpoints ship one as mtp.*); use 'ngram' or 'draft_model'")
    if weights not in ckpt:
        raise ValueError(f"speculative method 'mtp': the checkpoint {path} has no MTP weights ({weights} and the "
                         f"rest of mtp.* are missing); use 'ngram' or 'draft_model'")


def _check_max_model_len(max_model_len) -> None:
    if max_model_len is None:
        return
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len <= 0:
        raise ValueError(f"max_model_len={max_model_len!r}; it must be a positive number of tokens "
                         f"(or None for the checkpoint's max_position_embeddings)")


def load_model(path: str | Path, device="cpu", dtype: DType = torch.float32,
               max_model_len: Optional[int] = None, shard=None, with_mtp: bool = False) -> HybridModel:
    """Checkpoint directory (or a model id in the local Hugging Face cache: `resolve_checkpoint`)
    -> HybridModel in eval mode on `device` ("auto": cuda if available) with parameters in `dtype`.

    dtype: a torch.dtype, a name in DTYPES, or "auto" (config.json's dtype, float32 when it names
    none). max_model_len: caps the checkpoint's own limit (None keeps it). shard: a tensor-parallel
    rank's hybridkv.parallel.ShardLoad (its `cut` on the meta model, its `load` for the weights).
    Sets `generation_defaults` (GenerationDefaults from generation_config.json) on the model.
    with_mtp: load the checkpoint's MTP head too (speculative method 'mtp'); a family without one,
    or a checkpoint without its weights, is refused by name (ValueError).
    Raises FileNotFoundError (no directory / config.json), UnsupportedArchitectureError (listing
    the supported ones), ValueError for a bad dtype or max_model_len, and CheckpointError naming
    the file for everything wrong inside the directory (malformed JSON, an index without
    weight_map or with a shard outside the directory, a corrupt safetensors file, a count in
    config.json that is not positive, a tensor missing or of the wrong shape).
    """
    path = resolve_checkpoint(path)
    device = resolve_device(device)
    dtype = parse_dtype(dtype)
    _check_max_model_len(max_model_len)
    config, raw = load_config(path)
    arch = (getattr(config, "architectures", None) or [None])[0]
    family_module(arch)  # fail on the architecture before reading any weights
    defaults = read_generation_defaults(path)
    ckpt = CheckpointTensors(path)
    if with_mtp:
        check_mtp(arch, ckpt, path)
    if dtype == "auto":
        dtype = checkpoint_dtype(raw, path / "config.json")
        log.info("dtype='auto': computing in %s, the dtype config.json names (float32 when none)", dtype)
    try:
        model = build_model(config, device=device, dtype=dtype, cut=shard and shard.cut, with_mtp=with_mtp)
    except ValueError as e:  # a family refusing its config (heads that do not divide, ...)
        raise CheckpointError(f"{path / 'config.json'}: {e}") from e
    if shard is None:
        model.load_weights(ckpt)
    else:
        shard.load(model, ckpt)
    if max_model_len is not None:
        model.max_model_len = min(model.max_model_len or max_model_len, max_model_len)
    model.tokenizer = load_tokenizer(path)
    model.generation_defaults = defaults
    model.eos_token_ids = _eos_ids(defaults, config, model.tokenizer)
    model.fingerprint = fingerprint(raw, ckpt, dtype)
    return model.eval()
