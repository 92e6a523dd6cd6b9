"""The pre-norm decoder block most families share (Llama, Bamba, Jamba, GraniteMoeHybrid, Qwen3-Next,
LFM2, and every family file that subclasses `HybridDecoderLayer` or calls `run_layers`).

Per layer: norm -> `self_attn` (paged KV pool) or a recurrent mixer (state slot) -> residual ->
norm -> feed-forward -> residual. Each family builds its modules under the checkpoint's own names
and tells the base class those names, so parameter names stay the checkpoint's.
Families that differ in shape (Nemotron-H's one-mixer blocks) keep their own loops.

`run_layers` carries each block's last residual add into the next norm (`RMSNorm.add_forward`:
the add and the norm in one pass over the row, a C loop on CPU), the last one into the final norm.
"""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.specs import LayerSpec

from .forward_batch import ForwardBatch, ModelCaches
from .rotary import RotaryEmbedding
from .slot_split import SlotSplit, split_decode_prefill


class HybridDecoderLayer(nn.Module):
    """Base of a pre-norm residual block; a subclass sets the attribute NAMES of its modules:

    mixer_norm: the norm before the token mixer       (e.g. "input_layernorm")
    recurrent:  the recurrent mixer when the layer has no `self_attn` (e.g. "mamba")
    ff_norm:    the norm before the feed-forward      (e.g. "pre_ff_layernorm")
    ff:         the feed-forward module or method     (e.g. "feed_forward")
    residual_scale: each residual branch is multiplied by it (Granite's residual_multiplier)
    """

    mixer_norm = "input_layernorm"
    recurrent = "mamba"
    ff_norm = "pre_ff_layernorm"
    ff = "feed_forward"
    residual_scale = 1.0

    @property
    def is_attention(self) -> bool:
        return "self_attn" in self._modules  # (hasattr would raise and catch on recurrent layers)

    def cache_spec(self, dtype: torch.dtype) -> LayerSpec:
        """This layer's AttentionSpec or RecurrentSpec in cache dtype `dtype`."""
        if self.is_attention:
            return self.self_attn.spec(dtype)
        return getattr(self, self.recurrent).cache_spec(dtype)

    def mix_recurrent(self, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, i: int,
                      split: SlotSplit) -> torch.Tensor:
        """x [T, H] -> [T, H] through the recurrent mixer over layer i's conv and state pools (their
        codes in place, when the caches offer them and the mixer reads them: ModelCaches.state_codes)."""
        mixer = getattr(self, self.recurrent)
        if caches.state_codes is not None and getattr(mixer, "reads_codes", False):
            codes = caches.state_codes(i)
            y = None if codes is None else mixer.forward_codes(x, batch, codes)
            if y is not None:
                return y
        return mixer(x, batch, caches.conv[i], caches.state[i], split)

    def forward(self, h: torch.Tensor, rope, batch: ForwardBatch, caches: ModelCaches, i: int,
                split: SlotSplit) -> torch.Tensor:
        """h [T, H] residual stream -> [T, H]; this is model layer `i` (its pools in `caches`)."""
        h, out = self.forward_pending(h, None, rope, batch, caches, i, split)
        return h + out

    def forward_pending(self, h: torch.Tensor, pending: torch.Tensor | None, rope, batch: ForwardBatch,
                        caches: ModelCaches, i: int, split: SlotSplit) -> tuple[torch.Tensor, torch.Tensor]:
        """This block with its residual adds done inside the norms that follow them.

        h [T, H]: the residual stream without `pending` [T, H] (the previous block's last branch
        output, not yet added; None when there is none). Returns (h, this block's scaled
        feed-forward output, not yet added): the caller adds it, or hands it on.
        """
        h, x = add_then_norm(getattr(self, self.mixer_norm), h, pending)
        if self.is_attention:
            attn = self.self_attn
            pages = caches.kv_codes(i) if caches.kv_codes is not None and getattr(attn, "reads_codes", False) else None
            y = None if pages is None else attn.forward_codes(x, rope, batch, pages)  # codes in place
            x = y if y is not None else attn(x, rope, batch, caches.kv[i])
        else:
            x = self.mix_recurrent(x, batch, caches, i, split)
        scale = self.residual_scale
        h, x = add_then_norm(getattr(self, self.ff_norm), h, x if scale == 1.0 else x * scale)
        x = getattr(self, self.ff)(x)
        return h, (x if scale == 1.0 else x * scale)


def add_then_norm(norm: nn.Module, h: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, norm(h + delta)); delta None adds nothing. One pass where the norm fuses it."""
    if delta is None:
        return h, norm(h)
    fused = getattr(norm, "add_forward", None)
    if fused is None:
        h = h + delta
        return h, norm(h)
    return fused(h, delta)


def rotary_for(config, layers: nn.ModuleList) -> RotaryEmbedding | None:
    """Rope sized for the first attention layer's head_dim (partial rotary from the config), or
    None when no layer attends."""
    attn = [layer.self_attn for layer in layers if layer.is_attention]
    return RotaryEmbedding(config, attn[0].head_dim) if attn else None


def layer_cache_specs(layers: nn.ModuleList, dtype: torch.dtype) -> dict[int, LayerSpec]:
    """Model layer index -> that HybridDecoderLayer's spec, for every layer."""
    return {i: layer.cache_spec(dtype) for i, layer in enumerate(layers)}


def run_layers(layers: nn.ModuleList, h: torch.Tensor, rotary: RotaryEmbedding | None,
               batch: ForwardBatch, caches: ModelCaches, final_norm: nn.Module | None = None) -> torch.Tensor:
    """h [T, H] embeddings -> [T, H] after every layer, then `final_norm` when given.

    A block that keeps HybridDecoderLayer's forward hands its last residual add to the next norm
    (forward_pending); one that defines its own forward is called as a module, pending added first.
    """
    rope = rotary(batch.positions) if rotary is not None else None
    # one decode/prefill split shared by all recurrent mixers (none on attention-only models)
    split = None if all(layer.is_attention for layer in layers) else split_decode_prefill(batch)
    pending = None
    for i, layer in enumerate(layers):
        if type(layer).forward is HybridDecoderLayer.forward:
            h, pending = layer.forward_pending(h, pending, rope, batch, caches, i, split)
        else:
            h = layer(h if pending is None else h + pending, rope, batch, caches, i, split)
            pending = None
    if final_norm is None:
        return h if pending is None else h + pending
    return add_then_norm(final_norm, h, pending)[1]
