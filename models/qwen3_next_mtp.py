"""Qwen3-Next's multi-token-prediction (MTP) head, in the layout the published checkpoints ship
under `mtp.*` (the facts from vLLM's `qwen3_next_mtp.py`; transformers drops these weights):

    e = pre_fc_norm_embedding(embed(next token))       the target's embedding table
    x = fc(concat(e, pre_fc_norm_hidden(h)))            fc: [hidden, 2 x hidden], no bias
    x = layers[0](x)                                    a full-attention Qwen3-Next decoder layer
    logits = lm_head(norm(x))                           the target's lm_head

`h` at position p is the target's last hidden state there, after its final norm (what vLLM's
proposer hands its MTP model), and the next token is the one at p + 1, so the head's logits at
p propose the token at p + 2. Its layer attends over its own keys and values at every earlier
position: they live in the target's KV pools as one more attention layer (model layer index
`num_hidden_layers`: `cache_specs`), under the same block tables, so prefix hits, preemption,
swap and migration carry them with the target's. Its MoE-or-dense rule is that of layer 0
(vLLM numbers the MTP layer 0 within `mtp.layers`).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from .norms import RMSNorm


class Qwen3NextMtp(nn.Module):
    """The MTP head of a Qwen3-Next `config`; `layer_cls` builds its decoder layer (the family's
    Qwen3NextDecoderLayer), `layer_index` is its model layer index (its KV pool)."""

    def __init__(self, config, layer_cls, layer_index: int):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        one = copy.copy(config)
        one.layer_types = ["full_attention"] + list(config.layer_types[1:])
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, eps=eps, zero_centered=True)
        self.pre_fc_norm_hidden = RMSNorm(h, eps=eps, zero_centered=True)
        self.layers = nn.ModuleList([layer_cls(one, 0)])
        self.norm = RMSNorm(h, eps=eps, zero_centered=True)
        self.layer_index = layer_index

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, rope, batch, caches) -> torch.Tensor:
        """hidden [T, H] (the target's, after its final norm), next_embeds [T, H] (the embeddings of
        the token after each position) -> [T, H] after the head's final norm; writes the layer's KV
        at the batch's slots."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        x = self.layers[0](x, rope, batch, caches, self.layer_index, None)
        return self.norm(x)
