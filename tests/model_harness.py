"""A minimal multi-request driver over plain tensors, for model tests (no memory manager).

It allocates the pools from `model.cache_specs()`, hands out SHUFFLED non-contiguous KV blocks and
state slots, packs prefill chunks and decodes of several requests into one ForwardBatch, and can
copy a request's state slot into a fresh slot (a checkpoint) to continue from there.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from hybridkv.models.forward_batch import ForwardBatch, ModelCaches
from hybridkv.specs import AttentionSpec, RecurrentSpec


@dataclass
class Seq:
    """One request: all its tokens so far, its KV blocks, its live slot, tokens already computed."""

    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    slot: int = 0
    num_computed: int = 0
    last_logits: torch.Tensor | None = None  # logits after the last token, once all are computed


class Harness:
    def __init__(self, model, block_size: int = 16, num_blocks: int = 64, num_slots: int = 12,
                 seed: int = 0):
        self.model, self.bs = model, block_size
        dev, self.rng = model.device, random.Random(seed)
        kv, conv, state = {}, {}, {}
        for i, spec in model.cache_specs().items():
            if isinstance(spec, AttentionSpec):
                kv[i] = torch.zeros(num_blocks, spec.kv_parts, block_size, spec.num_kv_heads, spec.head_dim,
                                    dtype=spec.dtype, device=dev)
            elif isinstance(spec, RecurrentSpec):
                conv[i] = torch.zeros(num_slots, *spec.conv_shape, dtype=spec.dtype, device=dev)
                state[i] = torch.zeros(num_slots, *spec.state_shape, dtype=spec.ssm_dtype, device=dev)
        self.caches = ModelCaches(kv=kv, conv=conv, state=state, block_size=block_size)
        self.free_blocks = list(range(num_blocks))
        self.rng.shuffle(self.free_blocks)
        self.free_slots = list(range(1, num_slots))  # slot 0 is the null slot
        self.rng.shuffle(self.free_slots)
        # Fill the pools with garbage: a correct model never reads what it did not write.
        for t in (*kv.values(), *conv.values(), *state.values()):
            t.normal_()

    def add(self, tokens: list[int]) -> Seq:
        return Seq(list(tokens), slot=self.free_slots.pop())

    def step(self, work: list[tuple[Seq, int]], return_all_logits: bool = False) -> torch.Tensor:
        """Compute the next `n` tokens of each (seq, n) in ONE packed batch; returns the logits."""
        dev = self.model.device
        ids, pos, slots_map, qsl, seq_lens, tables = [], [], [], [0], [], []
        for seq, n in work:
            start, end = seq.num_computed, seq.num_computed + n
            assert 0 < n and end <= len(seq.tokens), (n, start, len(seq.tokens))
            while len(seq.blocks) * self.bs < end:
                seq.blocks.append(self.free_blocks.pop())
            ids += seq.tokens[start:end]
            pos += list(range(start, end))
            slots_map += [seq.blocks[p // self.bs] * self.bs + p % self.bs for p in range(start, end)]
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            tables.append(seq.blocks)
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        i32 = dict(dtype=torch.int32, device=dev)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(pos, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(qsl, **i32),
            seq_lens=torch.tensor(seq_lens, **i32),
            block_table=table.to(dev),
            slot_mapping=torch.tensor(slots_map, dtype=torch.long, device=dev),
            state_slots=torch.tensor([s.slot for s, _ in work], **i32),
            has_initial_state=torch.tensor([s.num_computed > 0 for s, _ in work], device=dev),
            return_all_logits=return_all_logits,
            query_lens_cpu=[n for _, n in work],
            seq_lens_cpu=seq_lens)
        with torch.no_grad():
            logits = self.model(batch, self.caches)
        for k, (seq, n) in enumerate(work):
            seq.num_computed += n
            if seq.num_computed == len(seq.tokens):
                seq.last_logits = logits[qsl[k + 1] - 1 if return_all_logits else k]
        return logits

    def prefill(self, seqs: list[Seq], chunk: int | None = None) -> torch.Tensor:
        """Run the uncomputed tokens of `seqs` together (at most `chunk` per request per step)."""
        logits = None
        while any(s.num_computed < len(s.tokens) for s in seqs):
            work = [(s, min(chunk or 1 << 30, len(s.tokens) - s.num_computed)) for s in seqs
                    if s.num_computed < len(s.tokens)]
            logits = self.step(work)
        return logits

    def decode(self, seqs: list[Seq], steps: int) -> list[list[int]]:
        """Greedy-decode `steps` tokens for every seq together (their prompts must be computed)."""
        out = [[] for _ in seqs]
        for step in range(steps):
            for k, s in enumerate(seqs):
                assert s.num_computed == len(s.tokens), "prefill the prompt first"
                tok = int(s.last_logits.argmax())
                s.tokens.append(tok)
                out[k].append(tok)
            if step + 1 < steps:
                self.step([(s, 1) for s in seqs])
        return out

    def checkpoint(self, seq: Seq) -> Seq:
        """A new Seq continuing from `seq` now: its state copied into a fresh slot, its full KV
        blocks shared (read-only: `seq.num_computed` must sit on a block boundary)."""
        assert seq.num_computed % self.bs == 0, "checkpoints are taken at block boundaries"
        slot = self.free_slots.pop()
        for i in self.caches.conv:
            self.caches.conv[i][slot] = self.caches.conv[i][seq.slot]
            self.caches.state[i][slot] = self.caches.state[i][seq.slot]
        nblk = seq.num_computed // self.bs
        return Seq(list(seq.tokens[:seq.num_computed]), blocks=list(seq.blocks[:nblk]), slot=slot,
                   num_computed=seq.num_computed)


# --- comparison with transformers -------------------------------------------------------------

def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    """transformers' logits for every position of `tokens`, one unpadded sequence, no cache."""
    with torch.no_grad():
        return hf_model(torch.tensor([tokens]), use_cache=False).logits[0].float()


def assert_close_rel(ours: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-4):
    """max |ours - ref| <= rtol * max |ref| (relative to the logits' scale)."""
    err = (ours.float() - ref.float()).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= rtol * scale, f"max abs error {err:.3e} > {rtol} x max|ref| {scale:.3e}"


def assert_greedy_matches_hf(hf_model, prompt: list[int], generated: list[int], tie: float = 1e-6):
    """`generated` is what transformers' greedy decoding of `prompt` produces.

    Teacher-forced: transformers scores prompt + generated in one pass; at every step our token
    must be its argmax. That equals running its greedy loop, token for token. A step where our
    token's logit is within `tie` of the max (a tie) is accepted by log-probability closeness.
    Returns the number of such ties.
    """
    logits = hf_logits(hf_model, prompt + generated)[len(prompt) - 1: len(prompt) - 1 + len(generated)]
    ties = 0
    for step, (row, tok) in enumerate(zip(logits, generated)):
        best = int(row.argmax())
        if best != tok:
            lp = torch.log_softmax(row, -1)
            gap = (lp[best] - lp[tok]).item()
            assert gap <= tie, (f"step {step}: ours {tok}, transformers {best}, log-prob gap {gap:.3e}"
                                f" (prompt length {len(prompt)}, ours {generated})")
            ties += 1
    return ties
