"""n > 1: when a request's first sequence finishes its prompt, its n - 1 siblings are made.

A fork shares the parent's blocks and starts from a copy of its state (the manager's `fork`),
so it samples from the same logits row this very step. A fork that finds no state slot, or no
seat under max_num_seqs, waits in the queue and prefills on its own (a prefix hit on the
parent's blocks).
"""
from __future__ import annotations

from hybridkv.cache_manager import HybridCacheManager

from .scheduler import Scheduler
from .sequence import Sequence, SequenceGroup


def fork_children(parent: Sequence, g: SequenceGroup, scheduler: Scheduler, mgr: HybridCacheManager
                  ) -> tuple[list[Sequence], int]:
    """(the sequences that sample from the parent's row: the parent, plus the forks that start
    running now; how many forks the manager made). Every pending sibling joins `g.seqs`."""
    out = [parent]
    if parent.seq_index != 0:
        return out, 0
    made = 0
    while g.forks_pending:
        j = len(g.seqs)
        child = parent.fork((g.key, j), j)  # a tuple: never equal to a user's id
        g.seqs.append(child)
        if (len(scheduler.running) < scheduler.max_seqs
                and mgr.fork(parent.request_id, child.request_id, token_ids=child.token_ids)):
            scheduler.add_running(child)
            made += 1
            out.append(child)
        else:
            scheduler.add(child)
    return out, made
