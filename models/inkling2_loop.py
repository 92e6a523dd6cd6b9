"""Inkling 2 Loop (the text model): Inkling 2 whose layers [loop_layer_index_start,
loop_layer_index_end) run `loop_num_passes` times per token, each later pass restarting from the
state before the loop and mixing in "messages" read from the previous pass (`message_input`,
gated into the looped layers' inputs by their `*_message_gate`s).

The loop is over depth, not time: every pass of a looped layer is, for the memory manager, one more
layer of its own. As transformers (which appends a copy of the loop layers' caches per extra
pass), pass p >= 1 of looped layer i has virtual layer index `num_hidden_layers + (p - 1) x
num_loop_layers + (i - start)`; with V virtual layers in all, virtual layer v keeps its KV pages
under cache key v and its four conv windows under key V + v. Each pass's KV and windows depend
only on the tokens before, so prefix hits, preemption and migration hold as for Inkling 2: no
prefix-caching exception is needed. Published `Inkling2LoopForConditionalGeneration` checkpoints
serve their text model. Tensor parallelism is refused.
"""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.specs import LayerSpec

from .forward_batch import ForwardBatch, ModelCaches
from .inkling2 import Inkling2Body, Inkling2Model, text_model_config
from .inkling2_attention import unweighted_rms_norm

ARCHITECTURE = "Inkling2LoopForCausalLM"


def tiny_config(**overrides):
    """A 6-layer Inkling2LoopTextConfig (sliding, full alternating; blocks of 2): layers 2-3 looped,
    2 passes, gate rank 8; the rest as Inkling 2's tiny config."""
    from transformers.models.inkling2_loop.configuration_inkling2_loop import Inkling2LoopTextConfig

    from .inkling2 import tiny_config as inkling2_tiny

    kw = {k: v for k, v in inkling2_tiny().to_dict().items() if k in Inkling2LoopTextConfig.__dataclass_fields__}
    kw.update(num_hidden_layers=6, layer_types=["hybrid_sliding", "hybrid"] * 3, loop_layer_index_start=2,
              loop_layer_index_end=4, loop_num_passes=2, loop_gate_rank=8, architectures=[ARCHITECTURE])
    kw.update(overrides)
    return Inkling2LoopTextConfig(**kw)


class MessageInput(nn.Module):
    """`message_input`: per looped layer j, 4 learned queries (q, k, v, feed-forward messages) over
    the previous pass's blocks and final state -> [T, 4, H] float32 (BlockAttentionResidual's mix)."""

    def __init__(self, hidden: int, num_loop_layers: int):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(num_loop_layers, 4, hidden))

    def forward(self, blocks: torch.Tensor, state: torch.Tensor, j: int) -> torch.Tensor:
        stacked = unweighted_rms_norm(torch.cat([blocks, state[:, None]], dim=1).float(), 1e-6)
        scores = torch.einsum("qh,tnh->tqn", self.query[j].float(), stacked) * stacked.shape[-1] ** -0.5
        return torch.einsum("tqn,tnh->tqh", torch.softmax(scores, dim=-1, dtype=torch.float32), stacked)


class _LoopBody(Inkling2Body):
    def __init__(self, config):
        start, end = config.loop_layer_index_start, config.loop_layer_index_end
        super().__init__(config, looped=range(start, end))
        self.message_input = MessageInput(config.hidden_size, end - start)


class Inkling2LoopModel(Inkling2Model):
    """Parameter names equal transformers'. Cache keys: virtual layer v (KV), V + v (conv windows)."""

    architecture = ARCHITECTURE

    def __init__(self, config):
        config = text_model_config(config)
        super().__init__(config, body=_LoopBody(config))
        self.start, self.end = config.loop_layer_index_start, config.loop_layer_index_end
        self.passes = int(config.loop_num_passes)
        n, loop = config.num_hidden_layers, self.end - self.start
        if not 0 < self.start < self.end <= n:
            raise ValueError(f"loop layers [{self.start}, {self.end}) must lie inside the {n} layers, after layer 0")
        # (layer, virtual layer, pass) in the order a token visits them
        self.schedule = [(i, i, 0) for i in range(self.end)]
        self.schedule += [(i, n + (p - 1) * loop + i - self.start, p)
                          for p in range(1, self.passes) for i in range(self.start, self.end)]
        self.schedule += [(i, i, 0) for i in range(self.end, n)]
        self.num_virtual = n + (self.passes - 1) * loop

    def cache_specs(self) -> dict[int, LayerSpec]:
        layers, V, dtype = self.model.layers, self.num_virtual, self.dtype
        specs: dict[int, LayerSpec] = {v: layers[i].self_attn.spec(dtype) for i, v, _ in self.schedule}
        specs.update({V + v: layers[i].conv_spec() for i, v, _ in self.schedule})
        return specs

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        body, V = self.model, self.num_virtual
        h = body.embed_tokens(batch.input_ids)
        dtype = h.dtype
        blocks = h.new_zeros(h.shape[0], 0, h.shape[1])
        pre = prev = None
        for i, v, p in self.schedule:
            if p == 0 and i == self.start:
                pre = (h, blocks)  # where every later pass restarts
            messages = None
            if p > 0:
                if i == self.start:  # a new pass: messages from the one before, blocks it added (less its first)
                    prev = (blocks[:, pre[1].shape[1] + 1:], h)
                    h, blocks = pre
                messages = body.message_input(prev[0], prev[1], i - self.start)
            layer = body.layers[i]
            new = layer(h, blocks, batch, caches.kv[v], caches.conv[V + v], messages)
            if layer.is_block_boundary:
                blocks = torch.cat([blocks, h[:, None]], dim=1)
            h = new
        h = body.norm(body.final_input(blocks, h)[0]).to(dtype)
        logits = self.compute_logits(h, batch, self.lm_head)
        return torch.tanh(logits / self.softcap) * self.softcap


MODEL_CLASS = Inkling2LoopModel
