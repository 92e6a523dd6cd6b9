"""GLM-5-Next's published tensor names (what transformers' save_pretrained writes too, through its
conversion mapping) answered under the text model's in-memory names, the model's parameter names.

Prefix: `model.language_model.` (the multimodal checkpoint) or `model.` (a flat text-only one).
Renames: `attn_hc.{fn,base,scale}` <- `hc_attn_{fn,base,scale}` (ffn alike); the KDA forget gate's
`self_attn.forget_gate.X` <- `self_attn.X`; the KDA conv `self_attn.conv1d.weight` <- the rows of
`q_conv1d`, `k_conv1d`, `v_conv1d` stacked. Per-expert weights stack in models/moe.py's PerExpertView.
"""
from __future__ import annotations

from .checkpoint import PartsView
from .kimi_linear import published_kda_parts

_HC = {f".{part}_hc.{w}": f".hc_{part}_{w}" for part in ("attn", "ffn") for w in ("fn", "base", "scale")}


def _renamed(rest: str) -> list[str]:
    """The stored names (one, or the three conv parts) of in-memory name `rest` (prefix removed)."""
    for ours, theirs in _HC.items():
        if rest.endswith(ours):
            return [rest[: -len(ours)] + theirs]
    return published_kda_parts(rest)


class Glm5NextNames(PartsView):
    """A checkpoint seen under in-memory names `model.*` / `lm_head.weight`; anything with
    `__contains__` and `get(name)` inside. A name stored as such is read as it is."""

    def _parts(self, name: str) -> list[str]:
        if name in self.ckpt or not name.startswith("model."):
            return [name]
        rest = name.removeprefix("model.")
        for prefix in ("model.language_model.", "model."):
            for parts in ([prefix + rest], [prefix + p for p in _renamed(rest)]):
                if all(p in self.ckpt for p in parts):
                    return parts
        return [name]
