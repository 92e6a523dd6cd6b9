"""BatchBuilder against a per-chunk reference: every field of the packed batch, over real scheduler
steps (prefill chunks, decodes, forks sharing blocks, sliding-window groups, no-attention models)."""
import random

import pytest
import torch

from hybridkv.cache_manager import HybridCacheManager
from hybridkv.request import Request
from hybridkv.sampling_params import SamplingParams
from hybridkv.scheduler.batch_builder import BatchBuilder
from hybridkv.scheduler.preemption import PreemptionPolicy
from hybridkv.scheduler.scheduler import Scheduler
from hybridkv.specs import AttentionSpec, RecurrentSpec

BS = 4
ATTN = AttentionSpec(1, 4, torch.float32)
SLIDING = AttentionSpec(1, 4, torch.float32, sliding_window=6)
REC = RecurrentSpec((2, 3), (2, 2), torch.float32)
MODELS = {
    "hybrid": {0: ATTN, 1: REC},
    "full+sliding+recurrent": {0: ATTN, 1: SLIDING, 2: REC},
    "sliding only": {0: SLIDING},
    "recurrent only": {0: REC},
}


def reference(chunks, mgr):
    """The batch from Python lists: the allocate() slots, the manager's tables and per-group slots."""
    ids, pos, slots, qsl, lens = [], [], [], [0], []
    for c in chunks:
        ids += c.seq.token_ids[c.start:c.start + c.num_tokens]
        pos += range(c.start, c.start + c.num_tokens)
        slots += c.slot_mapping
        qsl.append(qsl[-1] + c.num_tokens)
        lens.append(c.start + c.num_tokens)
    rids = [c.seq.request_id for c in chunks]
    tables = mgr.block_tables(rids)
    groups = {w: (tables[w], [s for c in chunks  # each group's own slots, as its memory computes them
                              for s in g.slot_mapping(c.seq.request_id, c.start, c.start + c.num_tokens)])
              for w, g in mgr.attention_groups.items()}
    return dict(input_ids=ids, positions=pos, slot_mapping=slots, query_start_loc=qsl, seq_lens=lens,
                state_slots=[mgr.live_slot(r) for r in rids], has_initial_state=[c.start > 0 for c in chunks],
                block_table=mgr.block_table(rids).tolist()), groups


def assert_same_batch(got, want) -> None:
    """Every field of two ForwardBatches equal (values and dtypes; each KV group's too)."""
    for name in ("input_ids", "positions", "query_start_loc", "seq_lens", "block_table", "slot_mapping",
                 "state_slots", "has_initial_state"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.tolist() == b.tolist(), name
    assert got.logits_indices is None and want.logits_indices is None
    assert (got.query_lens_cpu, got.seq_lens_cpu) == (want.query_lens_cpu, want.seq_lens_cpu)
    assert set(got.kv_groups) == set(want.kv_groups)
    for w, group in got.kv_groups.items():
        assert group.block_table.tolist() == want.kv_groups[w].block_table.tolist()
        assert group.slot_mapping.tolist() == want.kv_groups[w].slot_mapping.tolist()


@pytest.mark.parametrize("model", sorted(MODELS))
def test_batch_matches_per_chunk_reference(model):
    specs = MODELS[model]
    rng = random.Random(model)
    mgr = HybridCacheManager(specs, BS, 200, 40, fingerprint="t", max_num_batched_tokens=24)
    sched = Scheduler(mgr, PreemptionPolicy("recompute", specs, BS, None, True), 24, 8)
    builder = BatchBuilder(mgr, "cpu")
    shared = [rng.randrange(4, 500) for _ in range(9)]
    for i in range(10):  # some share a prefix (cached blocks), lengths cross block and chunk edges
        prompt = (shared if i % 2 else []) + [rng.randrange(4, 500) for _ in range(rng.randint(1, 30))]
        sched.add(Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 12)), arrival=float(i)))
    steps = mixed = decodes = 0
    while sched.has_unfinished():
        out = sched.schedule()
        chunks = out.all_chunks()
        assert chunks, "the pools are large enough for every request to progress"
        if out.decodes is not None and not out.chunks:  # a decode batch builds as its chunks would
            decodes += 1
            assert_same_batch(builder.build_decodes(out.decodes), builder.build(chunks))
        indices = sorted(rng.sample(range(out.num_tokens), min(3, out.num_tokens))) if steps % 3 == 0 else None
        batch = builder.build(chunks, indices)
        want, groups = reference(chunks, mgr)
        for name, value in want.items():
            assert getattr(batch, name).tolist() == value, name
        assert batch.query_start_loc.dtype == batch.seq_lens.dtype == batch.block_table.dtype == torch.int32
        assert batch.input_ids.dtype == batch.slot_mapping.dtype == batch.positions.dtype == torch.long
        assert batch.has_initial_state.dtype == torch.bool
        assert batch.query_lens_cpu == [c.num_tokens for c in chunks]
        assert batch.seq_lens_cpu == want["seq_lens"]
        assert (batch.logits_indices.tolist() if indices else None) == indices
        if len(mgr.attention_groups) > 1:
            assert set(batch.kv_groups) == set(groups)
            for w, (table, slots) in groups.items():
                assert batch.kv_groups[w].block_table.tolist() == table.tolist()
                assert batch.kv_groups[w].slot_mapping.tolist() == slots
        else:
            assert batch.kv_groups == {}
        if mgr.attention is None:
            assert set(want["slot_mapping"]) == {-1}
        mixed += any(c.num_tokens > 1 for c in chunks) and any(c.num_tokens == 1 for c in chunks)
        for c in chunks:
            mgr.commit(c.seq.request_id, c.num_tokens)
            if c.checkpoint:
                mgr.prefix_cache.checkpoint(c.seq.request_id)
            if c.start + c.num_tokens == c.seq.num_tokens:
                c.seq.append_token(rng.randrange(4, 500))
                if c.seq.num_output_tokens >= c.seq.params.max_tokens:
                    sched.finish(c.seq, "length")
        steps += 1
    assert steps > 5 and mixed and decodes, "the run covered prefill-only, mixed and decode-batch steps"


def test_a_batch_does_not_alias_the_next_steps_buffer():
    """The CPU path clones: a batch kept past its step still reads its own step's values."""
    specs = {0: ATTN}
    mgr = HybridCacheManager(specs, BS, 50, 8, fingerprint="t")
    sched = Scheduler(mgr, PreemptionPolicy("recompute", specs, BS, None, True), 64, 4)
    sched.add(Request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=4)))
    builder = BatchBuilder(mgr, "cpu")
    out = sched.schedule()
    first = builder.build(out.chunks)
    kept = first.input_ids.tolist(), first.positions.tolist()
    mgr.commit("a", 5)
    out.chunks[0].seq.append_token(11)
    second = builder.build(sched.schedule().all_chunks())
    assert (first.input_ids.tolist(), first.positions.tolist()) == kept == ([5, 6, 7, 8, 9], [0, 1, 2, 3, 4])
    assert (second.input_ids.tolist(), second.positions.tolist()) == ([11], [5])
