"""Which family module builds which Hugging Face architecture. Adding a family = one line here."""
from __future__ import annotations

import importlib
from types import ModuleType

# Hugging Face `config.architectures[0]` -> family module name inside hybridkv.models.
_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "BambaForCausalLM": "bamba",
    "JambaForCausalLM": "jamba",
    "Qwen3NextForCausalLM": "qwen3_next",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
    "NemotronHForCausalLM": "nemotron_h",
    "Lfm2ForCausalLM": "lfm2",
    "Zamba2ForCausalLM": "zamba2",
    "FalconH1ForCausalLM": "falcon_h1",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",  # published checkpoints: the text model alone
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "MambaForCausalLM": "mamba",
    "Mamba2ForCausalLM": "mamba2",
    "FalconMambaForCausalLM": "falcon_mamba",
    "RecurrentGemmaForCausalLM": "recurrent_gemma",
    "Lfm2MoeForCausalLM": "lfm2_moe",
    "ZambaForCausalLM": "zamba",
    "OlmoHybridForCausalLM": "olmo_hybrid",
    "MiniMaxForCausalLM": "minimax",
    "KimiLinearForCausalLM": "kimi_linear",
    "GptOssForCausalLM": "gpt_oss",
    "Lfm3ForCausalLM": "lfm3",
    "BailingHybridForCausalLM": "bailing_hybrid",
    "LaraMiniForCausalLM": "lara_mini",
    "GraniteMoeSWAForCausalLM": "granitemoe_swa",
    "RwkvForCausalLM": "rwkv",
    "ZayaForCausalLM": "zaya",
    "InklingForCausalLM": "inkling",
    "InklingForConditionalGeneration": "inkling",  # published checkpoints: the text model alone
    "Inkling2ForCausalLM": "inkling2",
    "Inkling2LoopForCausalLM": "inkling2_loop",
    "Inkling2ForConditionalGeneration": "inkling2",  # published checkpoints: the text model alone
    "Inkling2LoopForConditionalGeneration": "inkling2_loop",
    "Glm5NextForConditionalGeneration": "glm5_next",  # its text model (no ForCausalLM class exists)
    "Qwen4ExpForCausalLM": "qwen4_exp",
    "Qwen4ExpForConditionalGeneration": "qwen4_exp",  # published checkpoints: the text model alone
}


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture has no family module here."""


def supported_architectures() -> list[str]:
    """Architecture names (as in config.json `architectures`) this package can load."""
    return sorted(_ARCHITECTURES)


def family_names() -> list[str]:
    """Short family names (`llama`, `bamba`, ...) accepted by `family_module`."""
    return sorted(set(_ARCHITECTURES.values()))


def family_module(name: str | None) -> ModuleType:
    """The family module for an architecture (`BambaForCausalLM`) or a family name (`bamba`).

    A family module defines ARCHITECTURE (str), MODEL_CLASS (a HybridModel subclass) and
    tiny_config(**overrides) -> a transformers config for a tiny random checkpoint.
    """
    module_name = _ARCHITECTURES.get(name) if name in _ARCHITECTURES else None
    if module_name is None and name in family_names():
        module_name = name
    if module_name is None:
        raise UnsupportedArchitectureError(
            f"architecture {name!r} is not supported; supported architectures: "
            f"{', '.join(supported_architectures())}")
    return importlib.import_module(f"{__package__}.{module_name}")
