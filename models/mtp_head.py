"""The multi-token-prediction (MTP) head of Qwen3-Next and Qwen3.5 (dense and MoE), in the layout
their published checkpoints ship under `mtp.*` (the facts from vLLM's `qwen3_next_mtp.py` and
`qwen3_5_mtp.py`; transformers drops these weights):

    e = pre_fc_norm_embedding(embed(next token))       the target's embedding table
    x = fc(concat(e, pre_fc_norm_hidden(h)))            fc: [hidden, 2 x hidden], no bias
    x = layers[0](x)                                    a full-attention Qwen3-Next decoder layer
    logits = lm_head(norm(x))                           the target's lm_head

`h` at position p is the target's last hidden state there, after its final norm (what vLLM's
proposer hands its MTP model), and the next token is the one at p + 1, so the head's logits at
p propose the token at p + 2. Its layer attends over its own keys and values at every earlier
position: they live in the target's KV pools as one more attention layer (model layer index
`num_hidden_layers`: `cache_specs`), under the same block tables, so prefix hits, preemption,
swap and migration carry them with the target's. Its decoder layer is the family's own, built as
layer 0 (vLLM numbers the MTP layer 0 within `mtp.layers`: its MoE-or-dense rule is layer 0's).
A family model takes `WithMtp`: `init_mtp` in its constructor, `mtp_specs` in `cache_specs`,
`keep_hidden` on its final-norm hidden states in `forward`.

Chained proposals (num_speculative_tokens k > 1; vLLM chains its MTP layer the same way): after
the head's pass over the step, each proposing sequence runs the head again, one position on,
reading its own output (in place of the target's hidden state, which does not exist yet) and the
token it just proposed: step j at position p + j proposes the token at p + j + 2. Each such step
writes the head's KV at p + j, a position the target has not computed; the target's next step
computes it and the head's pass over that step writes it again before anything reads it (a read
covers only computed positions), so nothing of a chain outlives the proposal. A chain stays in
the block of its last computed position p (no block is allocated for it): it stops where p + j
would leave that block, so a proposal is shorter than k there (1 token when p ends its block).
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

from .forward_batch import ForwardBatch
from .norms import RMSNorm


class MtpHead(nn.Module):
    """The MTP head of a Qwen3-Next / Qwen3.5 `config`; `layer_cls(config, 0)` builds its decoder
    layer (the family's), `layer_index` is its model layer index (its KV pool)."""

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


class WithMtp:
    """What a family model with an MTP head adds (see the module doc): `mtp` (the head, or None
    when the engine does not draft with it) and `mtp_drafts`, which the model runner calls."""

    mtp_weights = "mtp.fc.weight"  # a checkpoint holding this ships the head (loader.check_mtp)

    def init_mtp(self, config, layer_cls, with_mtp: bool) -> None:
        self.mtp = MtpHead(config, layer_cls, config.num_hidden_layers) if with_mtp else None
        self.mtp_hidden = None  # with a head: the last forward's hidden states after the final norm

    def mtp_specs(self, specs: dict) -> dict:
        """The model's layer specs, with the head's attention layer when there is one."""
        if self.mtp is not None:
            specs[self.mtp.layer_index] = self.mtp.layers[0].cache_spec(self.dtype)
        return specs

    def keep_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, H] after the final norm, kept for the head (returned as is)."""
        if self.mtp is not None:
            self.mtp_hidden = h
        return h

    def mtp_drafts(self, batch, caches, next_ids: torch.Tensor, rows: list[int],
                   steps: Optional[list[int]] = None) -> list[list[int]]:
        """After forward(batch): the head over the same positions, each reading the token that
        follows it (`next_ids` [T]); writes the head's KV there and returns the greedy proposal at
        each of `rows`: the token two positions on, then up to steps[i] - 1 chained ones (module
        doc; None: none)."""
        h = self.mtp(self.mtp_hidden, self.model.embed_tokens(next_ids), self.rotary(batch.positions), batch, caches)
        self.mtp_hidden = None
        if not rows:
            return []
        h = h[rows]
        tokens = self.lm_head(h).argmax(dim=-1)
        drafts = [[t] for t in tokens.tolist()]
        if steps is not None and max(steps) > 1:
            self._chain(batch, caches, torch.tensor(rows, device=h.device), h, tokens, drafts, steps)
        return drafts

    def _chain(self, batch, caches, rows: torch.Tensor, h: torch.Tensor, tokens: torch.Tensor,
               drafts: list[list[int]], steps: list[int]) -> None:
        """Chained proposals (module doc): up to steps[i] - 1 more tokens for each of `rows` (the
        step's rows at which the head proposed `tokens` from its output `h`), appended to drafts."""
        bs = caches.block_size
        pos = batch.positions[rows]
        first = pos.tolist()
        req = torch.searchsorted(batch.query_start_loc[1:], rows, right=True)  # each row's request
        table = batch.kv_tables(None)[0]  # the head's layer is full attention
        for j in range(1, max(steps)):
            live = [i for i, p in enumerate(first) if j < steps[i] and p % bs + j < bs]  # p + j in p's block
            if not live:
                return
            idx = torch.tensor(live, device=h.device)
            p, tab, n = pos[idx] + j, table[req[idx]], len(live)
            one = torch.arange(n + 1, dtype=torch.int32, device=h.device)
            sub = ForwardBatch(
                input_ids=tokens[idx], positions=p, query_start_loc=one, seq_lens=(p + 1).to(torch.int32),
                block_table=tab, slot_mapping=tab[one[:n].long(), p // bs].long() * bs + p % bs,
                state_slots=torch.zeros(n, dtype=torch.int32, device=h.device),
                has_initial_state=torch.ones(n, dtype=torch.bool, device=h.device),
                query_lens_cpu=[1] * n, seq_lens_cpu=[q + j + 1 for q in (first[i] for i in live)])
            out = self.mtp(h[idx], self.model.embed_tokens(tokens[idx]), self.rotary(p), sub, caches)
            new = self.lm_head(out).argmax(dim=-1)
            h, tokens = h.clone(), tokens.clone()
            h[idx], tokens[idx] = out, new
            for i, t in zip(live, new.tolist()):
                drafts[i].append(t)
