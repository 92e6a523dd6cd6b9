"""Inkling 2's published tensor names (what transformers' save_pretrained writes too, through its
conversion mapping) answered under transformers' in-memory names, the model's parameter names.

Renames: `model.llm.` prefix, per-layer suffixes (SUFFIXES), the block-residual queries kept at
the top (`attn_res.attn_queries.{i - 1}` is layer i's attention_input, `attn_res.mlp_queries.{i}`
its mlp_input, `attn_res.output_query` the final one). Two tensors change on the way:
`mlp.experts.w13_weight` stores gate and up rows interleaved (g0, u0, g1, ...) and becomes gate
rows then up rows; `unembed.weight` is padded to `vocab_size` rows and keeps the first
`unpadded_vocab_size`. Inkling 2 Loop adds its looped layers' message gates (`controllers.*`) and
its message queries, stored as two tensors of [q, mlp] and [k, v] rows per looped layer (or both
under their in-memory names after `model.llm.`, as transformers 5.24 saves a tiny one). A
checkpoint already in the in-memory names is read as it is.
"""
from __future__ import annotations

import re

import torch

SUFFIXES = {
    "mlp.experts.gate_up_proj": "mlp.experts.w13_weight",
    "mlp.experts.down_proj": "mlp.experts.w2_weight",
    "mlp.gate.e_score_correction_bias": "mlp.gate.bias",
    "self_attn.q_proj.linear.weight": "attn.wq_du.weight",
    "self_attn.k_proj.linear.weight": "attn.wk_dv.weight",
    "self_attn.v_proj.linear.weight": "attn.wv_dv.weight",
    "self_attn.q_proj.norm.scale": "attn.q_l2_clip.scale",
    "self_attn.relative_position_bias.linear.weight": "attn.wr_du.weight",
    "self_attn.relative_position_bias.norm.scale": "attn.rel_l2_clip.scale",
    "self_attn.relative_position_bias.proj": "attn.rel_logits_proj.proj",
    "self_attn.o_proj.linear.weight": "attn.wo_ud.weight",
    "self_attn.o_proj.gate_proj.weight": "attn.gate_attn.weight",
    "self_attn.sink_proj.weight": "attn.attn_sink_proj.weight",
    "post_attention_convolution.conv1d.weight": "attn_sconv.weight",
    "post_mlp_convolution.conv1d.weight": "mlp_sconv.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "input_layernorm.weight": "attn_norm.weight",
    **{f"{x}_input_layernorm.weight": f"{x}_input_norm.weight" for x in "qkv"},
    **{f"self_attn.{x}_proj.sconv.{ours}": f"attn.{x}_sconv.{theirs}" for x in "kv"
       for ours, theirs in (("conv1d.weight", "weight"), ("static_weight", "static_w"),
                            ("weight_proj.weight", "weight_proj"))},
    **{f"{x}_message_gate.{ours}.weight": f"controllers.{c}.{theirs}"  # Inkling 2 Loop's looped layers
       for x, c in (("q", "attn"), ("k", "k"), ("v", "v"), ("mlp", "mlp"))
       for ours, theirs in (("down_proj", "down_weight"), ("message_gate_proj", "gain_weight"),
                            ("forget_gate_proj", "forget_weight"))},
}
MESSAGE_QUERIES = ("model.llm.middle_cycle_cross_pass_queries", "model.llm.middle_cycle_cross_pass_kv_queries")
TOP = {"lm_head.weight": "model.llm.unembed.weight", "model.embed_tokens.weight": "model.llm.embed.weight",
       "model.embed_tokens.embed_norm.weight": "model.llm.embed_norm.weight",
       "model.norm.weight": "model.llm.norm.weight", "model.final_input.query": "model.llm.attn_res.output_query"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def published_name(name: str) -> str:
    """The published checkpoint's name for in-memory parameter `name` (itself when not renamed)."""
    if name in TOP:
        return TOP[name]
    m = _LAYER.fullmatch(name)
    if m is None:
        return name
    i, rest = int(m.group(1)), m.group(2)
    if rest == "attention_input.query":
        return f"model.llm.attn_res.attn_queries.{i - 1}"
    if rest == "mlp_input.query":
        return f"model.llm.attn_res.mlp_queries.{i}"
    return f"model.llm.layers.{i}.{SUFFIXES.get(rest, rest)}"


class Inkling2CheckpointView:
    """A checkpoint read under in-memory names; `vocab` is the unembedding's kept row count."""

    def __init__(self, ckpt, vocab: int):
        self.ckpt, self.vocab = ckpt, vocab

    def _source(self, name: str) -> str:
        """The in-memory name, else the published one, else the in-memory name under `model.llm.`
        (transformers 5.24 saves the loop's gates and message queries so) or under a multimodal
        model's `model.language_model.`, whichever is stored."""
        rest = name.removeprefix("model.")
        for candidate in (name, published_name(name), "model.llm." + rest, "model.language_model." + rest):
            if candidate in self.ckpt:
                return candidate
        return published_name(name)

    def _merged_queries(self, name: str) -> bool:
        return name == "model.message_input.query" and self._source(name) not in self.ckpt

    def __contains__(self, name: str) -> bool:
        if self._merged_queries(name):
            return all(q in self.ckpt for q in MESSAGE_QUERIES)
        return self._source(name) in self.ckpt

    def get(self, name: str) -> torch.Tensor:
        if self._merged_queries(name):
            # [q, mlp] and [k, v] per looped layer, two rows each -> [layers, (q, k, v, mlp), H]
            qm, kv = (self.ckpt.get(q).unflatten(0, (-1, 2)) for q in MESSAGE_QUERIES)
            return torch.cat([qm[:, :1], kv, qm[:, 1:]], dim=1).contiguous()
        source = self._source(name)
        t = self.ckpt.get(source)
        if source.endswith("w13_weight"):  # interleaved gate / up rows -> gate rows, then up rows
            t = torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)
        elif source == TOP["lm_head.weight"]:
            t = t[:self.vocab]
        return t.contiguous()
