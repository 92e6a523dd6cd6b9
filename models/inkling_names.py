"""Inkling's published multimodal tensor names (`InklingForConditionalGeneration`: the text model
under `model.llm.`, as transformers' save_pretrained writes it too) answered under the text
model's parameter names.

Renames as transformers' conversion mapping for `inkling_mm_model`, read backwards: `embed` /
`embed_norm` / `norm` / `unembed` at the top, per layer `attn.w{q,k,v,r}_*` / `wo_ud` for the
projections, `attn_norm` / `mlp_norm` for the norms, convs without their `conv1d.` level. Three
tensors store gate and up rows interleaved (g0, u0, g1, ...) and are split: the dense MLP's
`mlp.w13_dn.weight` [2I, H], the experts' `w13_weight` [E, 2I, H] and the shared experts'
`shared_w13_weight` [S, 2I, H]. Names already stored as such (a text-only checkpoint, or the
multimodal in-memory `model.language_model.`) are read as they are.
"""
from __future__ import annotations

import re

import torch

SUFFIXES = {
    "self_attn.q_proj.weight": "attn.wq_du.weight", "self_attn.k_proj.weight": "attn.wk_dv.weight",
    "self_attn.v_proj.weight": "attn.wv_dv.weight", "self_attn.r_proj.weight": "attn.wr_du.weight",
    "self_attn.o_proj.weight": "attn.wo_ud.weight", "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight", "self_attn.k_sconv.conv1d.weight": "attn.k_sconv.weight",
    "self_attn.v_sconv.conv1d.weight": "attn.v_sconv.weight",
    "self_attn.rel_logits_proj.proj": "attn.rel_logits_proj.proj",
    "attn_sconv.conv1d.weight": "attn_sconv.weight", "mlp_sconv.conv1d.weight": "mlp_sconv.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight", "input_layernorm.weight": "attn_norm.weight",
    "mlp.down_proj.weight": "mlp.w2_md.weight", "mlp.experts.down_proj": "mlp.experts.w2_weight",
    "mlp.gate.e_score_correction_bias": "mlp.gate.bias", "mlp.shared_experts.down_proj": "mlp.shared_experts.shared_w2_weight",
}
# (parameter suffix) -> (stored suffix, dim of the interleaved rows, which half)
SPLIT = {"mlp.gate_proj.weight": ("mlp.w13_dn.weight", 0, 0), "mlp.up_proj.weight": ("mlp.w13_dn.weight", 0, 1),
         "mlp.experts.gate_up_proj": ("mlp.experts.w13_weight", 1, None),
         "mlp.shared_experts.gate_proj": ("mlp.shared_experts.shared_w13_weight", 1, 0),
         "mlp.shared_experts.up_proj": ("mlp.shared_experts.shared_w13_weight", 1, 1)}
TOP = {"lm_head.weight": "model.llm.unembed.weight", "model.embed_tokens.weight": "model.llm.embed.weight",
       "model.embed_tokens.embed_norm.weight": "model.llm.embed_norm.weight", "model.norm.weight": "model.llm.norm.weight"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _published(name: str) -> tuple[str, int | None, int | None]:
    """(stored name, interleaved dim or None, half or None: both halves, gate rows then up rows)."""
    if name in TOP:
        return TOP[name], None, None
    m = _LAYER.fullmatch(name)
    if m is None:
        return name, None, None
    prefix, rest = f"model.llm.layers.{m.group(1)}.", m.group(2)
    if rest in SPLIT:
        stored, dim, half = SPLIT[rest]
        return prefix + stored, dim, half
    return prefix + SUFFIXES.get(rest, rest), None, None


class InklingCheckpointView:
    """A checkpoint read under the text model's names (see the module docstring)."""

    def __init__(self, ckpt):
        self.ckpt = ckpt

    def _source(self, name: str) -> tuple[str, int | None, int | None]:
        nested = "model.language_model." + name.removeprefix("model.")
        for candidate in (name, nested):
            if candidate in self.ckpt:
                return candidate, None, None
        return _published(name)

    def __contains__(self, name: str) -> bool:
        return self._source(name)[0] in self.ckpt

    def get(self, name: str) -> torch.Tensor:
        source, dim, half = self._source(name)
        t = self.ckpt.get(source)
        if dim is not None:  # interleaved rows along dim -> gate rows, then up rows
            gate, up = t.unflatten(dim, (-1, 2)).unbind(dim + 1)
            t = torch.cat([gate, up], dim=dim) if half is None else (gate, up)[half]
        return t.contiguous()
