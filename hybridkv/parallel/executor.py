"""What executes an engine step on N tensor-parallel ranks: rank 0's model runner plus ranks 1..N-1.

One rank's executor is the `ModelRunner` itself (`Engine(executor=None)`). `TensorParallelExecutor`
wraps rank 0's runner: for each step the runner builds the model inputs (`prepare`), the
executor sends the pool moves made since the last step (the block and slot copies, swap-ins and
imports the scheduler's memory manager made: pool_mirror.py) and the inputs to the other ranks,
each of which applies the moves to its own pool shards and runs its shard of the model
(worker.py), then rank 0's runner runs its own (`run`) and samples. The all-reduces inside the
forward keep the ranks in step; only rank 0 samples.
"""
from __future__ import annotations

from .group import RankFailedError
from .messages import Forward, batch_fields
from .pool_mirror import RankMoves, mirror_pools, pool_plan


class TensorParallelExecutor:
    """`execute(scheduler_output, groups) -> RunnerOutput` over every rank, as ModelRunner's.

    runner: rank 0's ModelRunner (its manager's pools are mirrored here, before any request);
    ranks: the TensorParallel that started ranks 1..N-1 (tensor_parallel.py)."""

    def __init__(self, runner, ranks):
        self.runner, self.ranks = runner, ranks
        self.moves = RankMoves(ranks)
        manager = runner.mgr
        ranks.send([pool_plan(manager)])  # the other ranks build their pools in the shard's shapes
        mirror_pools(manager, self.moves, ranks.layouts, ranks.full_specs, ranks.size)

    def execute(self, out, groups: dict):
        step = self.runner.prepare(out, groups)
        if step.batch is not None and step.error is None:
            try:
                self.ranks.send(self.moves.take() + [Forward(batch_fields(step.batch))])
            except RankFailedError as e:  # this step's requests fail; LLM.step raises it after
                step.error = e
        return self.runner.run(step)
