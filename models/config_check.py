"""What config.json must hold before a model is built: sizes, head counts and lengths that are
positive integers. Checked on the raw JSON, before transformers divides by any of them."""
from __future__ import annotations

from pathlib import Path

from .checkpoint import CheckpointError

# Keys that count something (tokens, channels, heads, layers): a value <= 0 is no model at all.
# A key a family does not use is absent (or null) and is skipped; "auto" (Mamba's time_step_rank,
# Bamba's mamba_d_head) is derived by the transformers config class.
POSITIVE_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings",
    # recurrent layers: Mamba / Mamba2 / Bamba / Jamba / NemotronH / Zamba2 / Falcon-H1 names
    "state_size", "conv_kernel", "time_step_rank", "mamba_n_heads", "mamba_d_head", "mamba_d_state",
    "mamba_d_conv", "mamba_expand", "mamba_num_heads", "mamba_head_dim", "ssm_state_size",
    # gated delta net (Qwen3-Next, Qwen3.5)
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim",
    # RecurrentGemma (RG-LRU width, conv taps, attention window), LFM2 / LFM2-MoE, Zamba v1;
    # expert counts are left out: 0 means a dense model in some families (GraniteMoeHybrid)
    "lru_width", "conv1d_width", "attention_window_size", "conv_L_cache", "n_mamba_heads",
    "mamba_dt_rank",
    # latent attention (Kimi-Linear, BailingHybrid) and BailingHybrid's KDA conv and layer groups
    "kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "short_conv_kernel_size", "layer_group_size",
)
# Counts a family sets to 0 on purpose: GLM-5-Next's DSA layers are rotary-free, and its config
# class forces head_dim (the rotary part) and qk_rope_head_dim to 0.
ZERO_ALLOWED = {"glm5_next_text": ("head_dim", "qk_rope_head_dim"), "glm5_next": ("head_dim", "qk_rope_head_dim")}
# Keys that divide something (logits / cap): a positive number; 0 or less is no model either.
POSITIVE_NUMBER_KEYS = ("logits_soft_cap",)


def check_config(config: dict, file: Path) -> None:
    """Refuse a config.json dict (and its nested `text_config`) with a count that is not a
    positive integer, or a divisor (`logits_soft_cap`) that is not a positive number:
    CheckpointError naming the file, the key and the value."""
    sections = [("", config)]
    if isinstance(config.get("text_config"), dict):
        sections.append(("text_config.", config["text_config"]))
    for prefix, section in sections:
        for key in POSITIVE_KEYS:
            value = section.get(key)
            if value is None or value == "auto" or (value == 0 and key in ZERO_ALLOWED.get(section.get("model_type"), ())):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise CheckpointError(f"{file} has {prefix}{key}={value!r}; it must be a positive "
                                      f"integer: fix config.json or re-download the checkpoint")
        for key in POSITIVE_NUMBER_KEYS:
            value = section.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise CheckpointError(f"{file} has {prefix}{key}={value!r}; it must be a positive "
                                      f"number: fix config.json or re-download the checkpoint")
