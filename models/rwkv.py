"""RWKV-4: a stack of recurrent blocks and nothing else; no attention layer, no KV cache.

Block (HF names under `rwkv.blocks.N`): x + time_mix(ln1(x)), then + channel_mix(ln2(x)); block 0
first applies `pre_ln` to the embeddings; `rwkv.ln_out` and `head` at the end. Both mixes read the
previous token's (normed) input through a token shift: mixed = x * mix + prev * (1 - mix).
- time mix (`attention`): k, v, r = key / value / receptance of their mixes; out =
  output(sigmoid(r) * wkv), wkv the RWKV-4 recurrence (`ops.rwkv4_scan` / `rwkv4_state_update`);
- channel mix (`feed_forward`): sigmoid(receptance(mix_r)) * value(relu(key(mix_k)) ^ 2).

What a request keeps per layer is transformers' five state tensors, in one RecurrentMemory slot
(RecurrentSpec, no new kind of memory): the two token shifts (the last ln1 and ln2 outputs) as the
slot's `conv` part, `[2, hidden]` in the compute dtype, and the WKV numerator, denominator and
running max as its `state` part, `[3, attention_hidden]` in float32. Those states reset at position
0 (zero shifts, num = den = 0, max = -1e30), so a fresh request never reads its slot.

As transformers in eval mode: block b's `attention.output` and `feed_forward.value` weights are
divided by 2 ** (b // rescale_every) and the residual stream halved after every `rescale_every`
blocks (a float16 guard that changes the numbers only through the LayerNorms' eps); `time_decay`
and `time_first` stay float32 whatever the compute dtype.
"""
from __future__ import annotations

import torch
from torch import nn

from hybridkv.kernels import ops
from hybridkv.specs import LayerSpec, RecurrentSpec

from .base import HybridModel
from .forward_batch import ForwardBatch, ModelCaches
from .slot_split import SlotSplit, split_decode_prefill
from .token_shift import previous_token

ARCHITECTURE = "RwkvForCausalLM"
# No position embedding bounds the length (transformers runs RWKV as an RNN past context_length,
# which only caps one forward of its CUDA kernel); LLM(max_model_len=...) lowers it.
MAX_MODEL_LEN = 1 << 20
_FP32 = ("attention.time_decay", "attention.time_first")  # transformers' _keep_in_fp32_modules


def tiny_config(**overrides):
    """A 4-layer RwkvConfig: hidden 64, attention width 64, channel-mix width 128; the residual
    halved after every 2 blocks (rescale_every 2), so the rescaling is exercised."""
    from transformers import RwkvConfig

    kw = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, attention_hidden_size=64,
              intermediate_size=128, context_length=512, layer_norm_epsilon=1e-5, rescale_every=2,
              initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, architectures=[ARCHITECTURE])
    kw.update(overrides)
    return RwkvConfig(**kw)


class RwkvTimeMix(nn.Module):
    """transformers' RwkvSelfAttention: the token-shift mixes and the WKV recurrence."""

    def __init__(self, hidden_size: int, attention_hidden_size: int):
        super().__init__()
        self.attention_hidden_size = attention_hidden_size
        self.time_decay = nn.Parameter(torch.empty(attention_hidden_size))
        self.time_first = nn.Parameter(torch.empty(attention_hidden_size))
        self.time_mix_key = nn.Parameter(torch.empty(1, 1, hidden_size))
        self.time_mix_value = nn.Parameter(torch.empty(1, 1, hidden_size))
        self.time_mix_receptance = nn.Parameter(torch.empty(1, 1, hidden_size))
        self.key = nn.Linear(hidden_size, attention_hidden_size, bias=False)
        self.value = nn.Linear(hidden_size, attention_hidden_size, bias=False)
        self.receptance = nn.Linear(hidden_size, attention_hidden_size, bias=False)
        self.output = nn.Linear(attention_hidden_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, shifted: torch.Tensor, wkv_state: torch.Tensor,
                split: SlotSplit) -> torch.Tensor:
        """x, shifted [T, H] -> [T, H]; wkv_state [S, 3, A] float32, updated in place."""
        mk, mv, mr = (m.view(-1) for m in (self.time_mix_key, self.time_mix_value, self.time_mix_receptance))
        k = self.key(x * mk + shifted * (1 - mk))
        v = self.value(x * mv + shifted * (1 - mv))
        r = torch.sigmoid(self.receptance(x * mr + shifted * (1 - mr)))
        w, u = self.time_decay, self.time_first
        wkv = split.run(
            torch.cat([k, v], dim=-1),
            decode=lambda kv, s: ops.rwkv4_state_update(wkv_state, *kv.chunk(2, dim=-1), w, u, s.decode_slots),
            prefill=lambda kv, s: ops.rwkv4_scan(wkv_state, *kv.chunk(2, dim=-1), w, u, s.prefill_qsl,
                                                 s.prefill_slots, s.prefill_has_init),
            out_dim=self.attention_hidden_size, states=(wkv_state,))
        return self.output(r * wkv)


class RwkvChannelMix(nn.Module):
    """transformers' RwkvFeedForward: a squared-relu MLP gated by sigmoid(receptance)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.time_mix_key = nn.Parameter(torch.empty(1, 1, hidden_size))
        self.time_mix_receptance = nn.Parameter(torch.empty(1, 1, hidden_size))
        self.key = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.receptance = nn.Linear(hidden_size, hidden_size, bias=False)
        self.value = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, shifted: torch.Tensor) -> torch.Tensor:
        mk, mr = self.time_mix_key.view(-1), self.time_mix_receptance.view(-1)
        k = torch.square(torch.relu(self.key(x * mk + shifted * (1 - mk))))
        return torch.sigmoid(self.receptance(x * mr + shifted * (1 - mr))) * self.value(k)


class RwkvBlock(nn.Module):
    def __init__(self, config, i: int):
        super().__init__()
        h, eps = config.hidden_size, config.layer_norm_epsilon
        if i == 0:
            self.pre_ln = nn.LayerNorm(h, eps=eps)
        self.ln1 = nn.LayerNorm(h, eps=eps)
        self.ln2 = nn.LayerNorm(h, eps=eps)
        self.attention = RwkvTimeMix(h, config.attention_hidden_size)
        self.feed_forward = RwkvChannelMix(h, config.intermediate_size)

    def cache_spec(self, dtype: torch.dtype) -> RecurrentSpec:
        """Per slot: the two token shifts `[2, hidden]` (time mix, channel mix) in `dtype`; the WKV
        numerator, denominator and max `[3, attention_hidden]` in float32."""
        return RecurrentSpec(conv_shape=(2, self.ln1.normalized_shape[0]),
                             state_shape=(3, self.attention.attention_hidden_size), dtype=dtype,
                             state_dtype=None if dtype == torch.float32 else torch.float32)

    def forward(self, h: torch.Tensor, batch: ForwardBatch, shifts: torch.Tensor, wkv_state: torch.Tensor,
                split: SlotSplit) -> torch.Tensor:
        """h [T, H] -> [T, H]; shifts [S, 2, H] and wkv_state [S, 3, A] are this layer's pools."""
        if "pre_ln" in self._modules:
            h = self.pre_ln(h)
        x = self.ln1(h)
        h = h + self.attention(x, previous_token(x, shifts[:, 0], batch), wkv_state, split)
        x = self.ln2(h)
        return h + self.feed_forward(x, previous_token(x, shifts[:, 1], batch))


class _RwkvBody(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(RwkvBlock(config, i) for i in range(config.num_hidden_layers))
        self.ln_out = nn.LayerNorm(config.hidden_size)  # transformers' default eps, not the config's


class RwkvModel(HybridModel):
    """Pure-recurrent LM: one RecurrentSpec per block. Parameter names equal the HF checkpoint's."""

    architecture = ARCHITECTURE

    def __init__(self, config):
        super().__init__(config)
        self.rwkv = _RwkvBody(config)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rescale_every = int(config.rescale_every or 0)
        self.max_model_len = MAX_MODEL_LEN

    def tied_weights(self) -> dict[str, str]:
        if getattr(self.config, "tie_word_embeddings", False):
            return {"head.weight": "rwkv.embeddings.weight"}
        return {}

    @torch.no_grad()
    def load_weights(self, ckpt) -> None:
        """The checkpoint's weights; then time_decay / time_first re-read in float32 and the output
        weights rescaled per block, as transformers' eval mode does."""
        super().load_weights(ckpt)
        for b, block in enumerate(self.rwkv.blocks):
            for name in _FP32:
                module, attr = block.attention, name.split(".")[1]
                param = getattr(module, attr)
                param.data = ckpt.get(f"rwkv.blocks.{b}.{name}").to(device=param.device, dtype=torch.float32)
            if self.rescale_every > 0:
                scale = 2 ** (b // self.rescale_every)
                block.attention.output.weight.div_(scale)
                block.feed_forward.value.weight.div_(scale)

    def cache_specs(self) -> dict[int, LayerSpec]:
        return {i: block.cache_spec(self.dtype) for i, block in enumerate(self.rwkv.blocks)}

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        h = self.rwkv.embeddings(batch.input_ids)
        split = split_decode_prefill(batch)  # shared by every block
        for i, block in enumerate(self.rwkv.blocks):
            h = block(h, batch, caches.conv[i], caches.state[i], split)
            if self.rescale_every > 0 and (i + 1) % self.rescale_every == 0:
                h = h / 2
        return self.compute_logits(self.rwkv.ln_out(h), batch, self.head)


MODEL_CLASS = RwkvModel
