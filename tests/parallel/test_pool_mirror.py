"""Rank 0's mirrored pools and rank 1's ShardedPools, in one process: every data move rank 0's pools
make reaches rank 1 as a (pickled) move, so each rank holds its heads / channels of what one
device would hold, and reads return the one-device tensors. tests/engine/test_tensor_parallel.py
checks the same through processes and whole engines."""
import pickle

import torch

from hybridkv.block_pool import BlockPool
from hybridkv.cache_manager import HybridCacheManager
from hybridkv.parallel.pool_mirror import RankMoves, mirror_pools, pool_plan
from hybridkv.parallel.pool_moves import PoolPlan, ShardedPools
from hybridkv.parallel.shard_layout import CacheShard, ShardLayout
from hybridkv.specs import AttentionSpec, RecurrentSpec
from hybridkv.state_pool import StatePool

HEADS, HEAD_DIM, CONV, K, SSM_HEADS, P, N = 2, 4, 6, 3, 2, 2, 3
FULL = {0: AttentionSpec(HEADS, HEAD_DIM, torch.float32),
        1: RecurrentSpec((CONV, K), (SSM_HEADS, P, N), torch.float32)}
SHARD = {0: AttentionSpec(HEADS // 2, HEAD_DIM, torch.float32),
         1: RecurrentSpec((CONV // 2, K), (SSM_HEADS // 2, P, N), torch.float32)}
LAYOUTS = {0: CacheShard(kv=ShardLayout.of((HEADS, 2))),
           1: CacheShard(conv=ShardLayout.of((CONV, 2)), state=ShardLayout.of((SSM_HEADS, 2)))}
BLOCKS, SLOTS, BS = 6, 5, 4


class InProcessRanks:
    """Rank 1 in this process: each message is pickled, as over the wire, and applied in order."""

    def __init__(self):
        self.rank1 = None
        self.sent = []

    def send(self, items):
        answer = None
        for item in pickle.loads(pickle.dumps(items)):
            self.sent.append(type(item).__name__)
            if isinstance(item, PoolPlan):
                self.rank1 = ShardedPools(SHARD, LAYOUTS, 1, 2, item, "cpu")
            else:
                answer = item.apply(self.rank1)  # a read's answer: it comes last
        return answer

    def ask(self, items):
        return [self.send(items)]


def _pools():
    ranks = InProcessRanks()
    mgr = HybridCacheManager(SHARD, BS, BLOCKS, SLOTS)
    ranks.send([pool_plan(mgr)])
    mirror_pools(mgr, RankMoves(ranks), LAYOUTS, FULL, 2)
    return mgr, ranks, BlockPool({0: FULL[0]}, BLOCKS, BS), StatePool({1: FULL[1]}, SLOTS)


def test_block_moves_reach_rank1_and_reads_return_every_head():
    mgr, ranks, one_kv, _ = _pools()
    kv = mgr.attention.pool
    data = {0: torch.randn(2, 2, BS, HEADS, HEAD_DIM)}
    for pool in (kv, one_kv):
        pool.scatter([1, 4], data)
        pool.copy_block(4, 2)
    assert "ScatterBlocks" not in ranks.sent  # moves wait for the next step (or a read)
    got = kv.gather([2, 1, 4])
    assert ranks.sent[-3:] == ["ScatterBlocks", "CopyBlock", "ReadBlocks"]  # in the order they were made
    assert torch.equal(got[0], one_kv.gather([2, 1, 4])[0])
    layout = LAYOUTS[0].kv
    assert torch.equal(kv.kv[0], layout.take(one_kv.kv[0], 0, 2, 3))
    assert torch.equal(ranks.rank1.blocks[None].kv[0], layout.take(one_kv.kv[0], 1, 2, 3))
    assert mgr.attention.layers == {0: FULL[0]}  # snapshots are checked against the full specs


def test_slot_moves_reach_rank1_and_reads_return_every_channel():
    mgr, ranks, _, one_states = _pools()
    states = mgr.recurrent.states
    conv, ssm = {1: torch.randn(CONV, K)}, {1: torch.randn(SSM_HEADS, P, N)}
    for pool in (states, one_states):
        pool.from_host(1, conv, ssm)
        pool.copy(1, 2)
        with pool.deferred_copies():  # a step's checkpoints: copied at the exit here, in order there
            pool.copy(2, 3)
            pool.copy(1, 4)
    for slot in (1, 3, 4):
        got, want = states.to_host(slot), one_states.to_host(slot)
        assert torch.equal(got[0][1], want[0][1]) and torch.equal(got[1][1], want[1][1]), slot
    assert ranks.sent.count("CopySlot") == 3 and ranks.sent.count("WriteSlot") == 1
    assert torch.equal(ranks.rank1.states.ssm[1], LAYOUTS[1].state.take(one_states.ssm[1], 1, 2, 1))  # dim 1: heads
    assert torch.equal(states.conv[1], LAYOUTS[1].conv.take(one_states.conv[1], 0, 2, 1))
