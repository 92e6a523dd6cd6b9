"""Stress the dual memory manager: tight budgets, preemption, aborts, forks and migrations at once.

    python examples/preemption_stress.py --small          # the CI size (about 20 s on 2 cores)
    python examples/preemption_stress.py                  # more requests, more steps
    python examples/preemption_stress.py --checkpoint DIR # a real checkpoint instead of a tiny Bamba

The same requests (greedy and seeded sampling, some with n > 1, prompts that share system
prefixes) run twice:
  1. roomy: one engine with memory to spare, everything submitted at once (`generate`);
  2. stressed: two engines of the same checkpoint on budgets tight enough to preempt (engine A
     preempts by recompute, engine B by swap, by default), requests arriving over time, random
     aborts, and random migrations mid-decode (`export_request` on one engine, `import_request`
     on the other; a snapshot that does not fit yet waits and is retried each step).
Every request that was not aborted must produce exactly the tokens of the roomy run, and at the
end both engines must hold 0 KV blocks and 0 live state slots. Prints the counts (preemptions
by mode, swaps, migrations, prefix hits, forks, aborts); exits 1 on any divergence or leak.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
from dataclasses import dataclass

from hybridkv import LLM, SamplingParams
from hybridkv.plan import kv_bytes_per_block, state_bytes_per_slot


@dataclass
class Workload:
    prompts: list[list[int]]
    params: list[SamplingParams]


def make_workload(n: int, vocab: int, rng: random.Random, max_prompt: int, max_new: int) -> Workload:
    """n requests: a third greedy, the rest seeded sampling; every fifth has n=2 (a fork); prompts
    start with one of three shared system prefixes (prefix hits) or nothing."""
    systems = [[rng.randrange(4, vocab) for _ in range(rng.randint(20, 40))] for _ in range(3)] + [[]]
    prompts, params = [], []
    for i in range(n):
        head = rng.choice(systems)
        tail = [rng.randrange(4, vocab) for _ in range(rng.randint(1, max(1, max_prompt - len(head))))]
        prompts.append(head + tail)
        kw = dict(max_tokens=rng.randint(2, max_new), ignore_eos=True)
        if i % 3 == 0:
            kw.update(temperature=0.0)
        else:
            kw.update(temperature=0.9, top_p=0.9, top_k=rng.choice([0, 20]), seed=1000 + i)
        if i % 5 == 4:
            kw.update(n=2, temperature=0.9, seed=2000 + i)
        params.append(SamplingParams(**kw))
    return Workload(prompts, params)


def tight_llm(path: str, mode: str, blocks: int, max_seqs: int, ckpt_slots: int, max_batched: int) -> LLM:
    """An engine whose pools hold exactly `blocks` KV blocks, `max_seqs` live slots and
    `ckpt_slots` checkpoint slots."""
    probe = LLM(path, memory_budget_bytes=8 << 20, max_num_seqs=2)
    specs = probe.model.cache_specs()
    kv, slot = kv_bytes_per_block(specs, 16), state_bytes_per_slot(specs)
    budget = kv * blocks + slot * (1 + max_seqs + ckpt_slots)
    share = (slot * ckpt_slots + 0.5) / budget  # + 0.5 byte: plan() floors the slot count
    return LLM(path, memory_budget_bytes=budget, max_num_seqs=max_seqs, preemption_mode=mode,
               max_num_batched_tokens=max_batched, checkpoint_policy="branch_points",
               checkpoint_share=share)


class Stress:
    """Drives two engines with arrivals, aborts and migrations; collects finished outputs."""

    def __init__(self, engines: list[LLM], work: Workload, rng: random.Random, p_abort: float, p_migrate: float):
        self.engines, self.work, self.rng = engines, work, rng
        self.p_abort, self.p_migrate = p_abort, p_migrate
        self.owner: dict[str, int] = {}          # live request id -> engine index
        self.pending: list[tuple[int, object]] = []  # (destination, snapshot) not imported yet
        self.done: dict[str, list[list[int]]] = {}
        self.aborted: set[str] = set()
        self.migrations = 0
        self.failed_imports = 0

    def submit(self, i: int) -> None:
        rid = f"r{i}"
        e = 0 if self.rng.random() < 0.7 else 1
        self.engines[e].add_request(self.work.prompts[i], self.work.params[i], request_id=rid)
        self.owner[rid] = e

    def _migrate(self) -> None:
        movable = [r for r, e in self.owner.items() if self._mid_decode(r, e)]
        if not movable:
            return
        rid = self.rng.choice(movable)
        src = self.owner.pop(rid)
        snap = self.engines[src].export_request(rid)
        self.pending.append((1 - src, snap))
        self.migrations += 1

    def _mid_decode(self, rid: str, e: int) -> bool:
        g = self.engines[e].engine.groups.get(rid)
        return g is not None and g.params.n == 1 and bool(g.seqs[0].output_token_ids) and not g.finished

    def _import_pending(self) -> None:
        still = []
        for dst, snap in self.pending:
            try:
                self.engines[dst].import_request(snap)
                self.owner[str(snap.req_id)] = dst
            except RuntimeError:  # the destination's pools are full now: retry next step
                self.failed_imports += 1
                still.append((dst, snap))
        self.pending = still

    def _abort(self) -> None:
        if not self.owner:
            return
        rid = self.rng.choice(sorted(self.owner))
        self.engines[self.owner.pop(rid)].abort(rid)
        self.aborted.add(rid)

    def run(self, arrivals_per_step: int) -> None:
        queue = list(range(len(self.work.prompts)))
        for _ in range(len(queue) // 2):  # half arrive at once, the rest over the next steps
            self.submit(queue.pop(0))
        steps = 0
        while queue or self.owner or self.pending:
            for _ in range(min(arrivals_per_step, len(queue))):
                self.submit(queue.pop(0))
            if self.rng.random() < self.p_abort:
                self._abort()
            if self.rng.random() < self.p_migrate:
                self._migrate()
            self._import_pending()
            for llm in self.engines:
                for out in llm.step():
                    if out.finished:
                        self.done[out.request_id] = [o.token_ids for o in out.outputs]
                        self.owner.pop(out.request_id, None)
            steps += 1
            if steps > 20_000:
                raise RuntimeError("the stressed engines made no progress in 20000 steps")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Preemption / abort / fork / migration stress against a roomy run.")
    ap.add_argument("--checkpoint", help="checkpoint directory (default: a tiny random Bamba in a temp dir)")
    ap.add_argument("--small", action="store_true", help="the CI configuration")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode-a", default="recompute", choices=["recompute", "swap", "auto"])
    ap.add_argument("--mode-b", default="swap", choices=["recompute", "swap", "auto"])
    ap.add_argument("--inject-fault", action="store_true",
                    help="corrupt every swapped-in state (shows that the comparison catches a broken swap)")
    args = ap.parse_args(argv)
    if args.inject_fault:
        inject_swap_fault()
    n = args.requests or (16 if args.small else 48)
    max_prompt, max_new = (48, 16) if args.small else (90, 32)
    with tempfile.TemporaryDirectory() as d:
        path = args.checkpoint
        if path is None:
            from hybridkv.models.tiny import make_tiny_checkpoint

            path = str(make_tiny_checkpoint("bamba", d))
        return run(path, n, max_prompt, max_new, args)


def inject_swap_fault() -> None:
    """Make swap-in restore a perturbed state and KV: a real memory bug the stress run must report."""
    from hybridkv.memory.full_attention import FullAttentionMemory
    from hybridkv.memory.recurrent import RecurrentMemory

    def corrupt(kind, field):
        real = kind.swap_in

        def swap_in(self, rid, copy, hashes, num_computed):
            copy = dict(copy, **{field: {i: t * 1.5 + 0.5 for i, t in copy[field].items()}})
            real(self, rid, copy, hashes, num_computed)
        kind.swap_in = swap_in

    corrupt(RecurrentMemory, "ssm")
    corrupt(FullAttentionMemory, "kv")


def run(path: str, n: int, max_prompt: int, max_new: int, args) -> int:
    rng = random.Random(args.seed)
    roomy = LLM(path, memory_budget_bytes=64 << 20, max_num_seqs=n * 2, max_num_batched_tokens=256)
    work = make_workload(n, roomy.model.vocab_size, rng, max_prompt, max_new)
    ref = {f"r{i}": [o.token_ids for o in out.outputs]
           for i, out in enumerate(roomy.generate(work.prompts, work.params, use_tqdm=False))}
    # Each engine fits the largest request (+ a fork) with little to spare: it must preempt.
    biggest = -(-(max_prompt + max_new) // 16) + 2
    engines = [tight_llm(path, args.mode_a, blocks=biggest + 4, max_seqs=5, ckpt_slots=2, max_batched=48),
               tight_llm(path, args.mode_b, blocks=biggest + 4, max_seqs=5, ckpt_slots=2, max_batched=48)]
    stress = Stress(engines, work, rng, p_abort=0.03, p_migrate=0.25)
    stress.run(arrivals_per_step=1)

    diverged = [r for r in ref if r not in stress.aborted and stress.done.get(r) != ref[r]]
    missing = [r for r in ref if r not in stress.aborted and r not in stress.done]
    stats = [e.stats() for e in engines]
    total = lambda key: sum(s[key] for s in stats)  # noqa: E731
    pre = {m: sum(s["preemptions"][m] for s in stats) for m in ("recompute", "swap")}
    print(f"requests: {n} ({sum(p.n for p in work.params)} sequences), finished {len(stress.done)}, "
          f"aborted {len(stress.aborted)}")
    print(f"preemptions: recompute {pre['recompute']}, swap {pre['swap']}")
    print(f"swaps: {total('swaps')}")
    print(f"migrations: {stress.migrations} (imports retried {stress.failed_imports} times)")
    print(f"prefix hits: {total('prefix_hit_tokens')} tokens")
    print(f"forks: {total('forks')}")
    ok = True
    for name, s in zip("AB", stats):
        leak = s["kv_blocks_used"] != 0 or s["state_slots_live"] != 0
        print(f"engine {name}: kv_blocks_used {s['kv_blocks_used']}, state_slots_live {s['state_slots_live']}"
              f", steps {s['steps']}{'  LEAK' if leak else ''}")
        ok &= not leak
    for r in diverged + missing:
        print(f"DIVERGED {r}: roomy {ref[r]} stressed {stress.done.get(r)}")
    ok &= not diverged and not missing
    print(f"compared {n - len(stress.aborted)} requests with the roomy run: "
          + ("all identical" if not (diverged or missing) else f"{len(diverged) + len(missing)} differ"))
    print("RESULT:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
