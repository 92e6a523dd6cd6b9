"""Checks shared by the delta-rule kernel tests (GDN: tests/kernels/test_gdn.py, KDA:
tests/kernels/test_kda.py): our torch references against transformers' torch functions of the same
rule, and the public step entry point on both backends.

A test file describes its rule once as a `DeltaRule` (how to draw inputs, transformers' chunked and
recurrent functions, our chunk-scan and step references, the state shape) and keeps what is
specific to it: its Triton step test, its bad-input test.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from state_kernel_helpers import pieces, qsl, rel_err, shuffled_slots, untouched


@dataclass(frozen=True)
class DeltaRule:
    inputs: Callable  # (gen, T) -> (q, k, v, g, beta) for T tokens
    hf_chunk: Callable  # transformers' chunked function (torch path)
    hf_recurrent: Callable  # transformers' recurrent function (torch path)
    chunk_scan_ref: Callable  # ours: (pool, q, k, v, g, beta, qsl, slots, init, scale, l2norm, cs, at)
    state_update_ref: Callable  # ours: (pool, q, k, v, g, beta, slots)
    state_shape: tuple[int, int, int]  # one slot: (value heads, K, V)
    slots: int

    def pool(self, gen: torch.Generator) -> torch.Tensor:
        return torch.randn(self.slots, *self.state_shape, generator=gen)

    def hf(self, q, k, v, g, beta, h0=None, chunk_size=8):
        """transformers' chunked rule for one request: (o [L, HV, V], state [HV, K, V])."""
        o, s = self.hf_chunk(q[None], k[None], v[None], g=g[None], beta=beta[None],
                             chunk_size=chunk_size,
                             initial_state=None if h0 is None else h0[None].clone(),
                             output_final_state=True, use_qk_l2norm_in_kernel=True)
        return o[0], s[0]

    def call(self, pool, inp, lengths, slots, init, chunk_size=16, return_states_at=None):
        """Our chunked reference on varlen requests, l2-normalised q / k, default scale."""
        q, k, v, g, beta = inp
        return self.chunk_scan_ref(pool, q, k, v, g, beta, qsl(lengths), slots,
                                   torch.tensor(init), None, True, chunk_size, return_states_at)


def check_one_pass_and_pieces_match_transformers(rule: DeltaRule, chunk_size: int):
    """One 35-token request in one call, then cut in uneven pieces carried through the slot."""
    gen = torch.Generator().manual_seed(0)
    T = 35
    inp = rule.inputs(gen, T)
    want_o, want_s = rule.hf(*inp)
    pool = rule.pool(gen)
    slot = torch.tensor([2], dtype=torch.int32)
    o = rule.call(pool, inp, [T], slot, [False], chunk_size)
    assert rel_err(o, want_o) < 1e-5 and rel_err(pool[2], want_s) < 1e-5
    pool = rule.pool(gen)
    outs = [rule.call(pool, [t[s:e] for t in inp], [e - s], slot, [i > 0], chunk_size)
            for i, (s, e) in enumerate(pieces(T))]
    assert rel_err(torch.cat(outs), want_o) < 1e-5 and rel_err(pool[2], want_s) < 1e-5


def check_varlen_from_slot_states_matches_transformers(rule: DeltaRule):
    """Ragged requests starting from (or without) their slots' states, each against transformers
    run alone from that state; every other slot stays bit-identical."""
    gen = torch.Generator().manual_seed(1)
    lengths, init = [9, 1, 17, 3], [True, False, True, True]
    inp = rule.inputs(gen, sum(lengths))
    pool = rule.pool(gen) * 0.3
    before = pool.clone()
    slots = shuffled_slots(len(lengths), rule.slots, gen)
    o = rule.call(pool, inp, lengths, slots, init, chunk_size=8)
    start = 0
    for n, has, s in zip(lengths, init, slots.tolist()):
        part = [t[start:start + n] for t in inp]
        want_o, want_s = rule.hf(*part, h0=before[s] if has else None, chunk_size=4)
        assert rel_err(o[start:start + n], want_o) < 1e-5
        assert rel_err(pool[s], want_s) < 1e-5
        start += n
    assert untouched(before, pool, slots)


def check_return_states_at_equals_prefix_state(rule: DeltaRule):
    """States saved mid-request equal transformers' final state of that prefix."""
    gen = torch.Generator().manual_seed(2)
    lengths = [5, 30]
    inp = rule.inputs(gen, sum(lengths))
    pool = rule.pool(gen)
    slots = torch.tensor([6, 1], dtype=torch.int32)
    _, states = rule.call(pool, inp, lengths, slots, [False, False], 8, [[5], [16, 3, 30]])
    for pos, got in zip([16, 3, 30], states[1]):
        assert rel_err(got, rule.hf(*[t[5:5 + pos] for t in inp])[1]) < 1e-5
    assert torch.equal(states[0][0], pool[6])


def check_decode_step_matches_transformers(rule: DeltaRule, requests: int):
    """One token for each of `requests` requests in shuffled slots against transformers'
    recurrent function from the same states."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta = rule.inputs(gen, requests)
    pool = rule.pool(gen)
    before = pool.clone()
    slots = shuffled_slots(requests, rule.slots, gen)
    o = rule.state_update_ref(pool, q, k, v, g, beta, slots)
    want_o, want_s = rule.hf_recurrent(q[:, None], k[:, None], v[:, None], g=g[:, None],
                                       beta=beta[:, None],
                                       initial_state=before[slots.long()].clone(),
                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert rel_err(o, want_o[:, 0]) < 1e-6 and rel_err(pool[slots.long()], want_s) < 1e-6
    assert untouched(before, pool, slots)


def check_decode_steps_continue_a_prefill(rule: DeltaRule):
    """A 9-token prefill then three single-token steps equal transformers over all 12 tokens."""
    gen = torch.Generator().manual_seed(4)
    inp = rule.inputs(gen, 12)
    pool = rule.pool(gen)
    slot = torch.tensor([4], dtype=torch.int32)
    want_o, want_s = rule.hf(*inp)
    outs = [rule.call(pool, [t[:9] for t in inp], [9], slot, [False])]
    for t in range(9, 12):
        q, k, v, g, beta = (u[t:t + 1] for u in inp)
        outs.append(rule.state_update_ref(pool, q, k, v, g, beta, slot))
    assert rel_err(torch.cat(outs), want_o) < 1e-5 and rel_err(pool[4], want_s) < 1e-5


def check_public_step_runs_both_backends(monkeypatch, rule: DeltaRule, public: Callable,
                                         tol: float):
    """`public(pool, q, k, v, g, beta, slots)` gives the same outputs and states with
    HYBRIDKV_BACKEND=torch and =triton."""
    gen = torch.Generator().manual_seed(41)
    q, k, v, g, beta = rule.inputs(gen, 2)
    res = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("HYBRIDKV_BACKEND", backend)
        pool = rule.pool(torch.Generator().manual_seed(42))
        o = public(pool, q, k, v, g, beta, torch.tensor([6, 3], dtype=torch.int32))
        res[backend] = (o, pool)
    assert rel_err(res["triton"][0], res["torch"][0]) < tol
    assert rel_err(res["triton"][1], res["torch"][1]) < tol
