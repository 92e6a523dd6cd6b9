"""Migrate a live request mid-decode, KV and state together: in one process and across two
processes over torch.distributed (gloo); it continues with exactly the tokens it would have made."""
import os
import subprocess
import sys
import textwrap

import pytest

from hybridkv import LLM, SamplingParams
from hybridkv.errors import SnapshotMismatchError
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.scheduler.snapshot_io import snapshot_from_bytes, snapshot_to_bytes

from engine_fixtures import assert_no_leaks, greedy

PROMPTS = [[5, 9, 13] * 7, list(range(4, 44)), [7] * 3]
SEEDED = SamplingParams(temperature=0.8, top_k=30, seed=123, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module", params=["bamba", "llama"])
def ckpt(request, tmp_path_factory):
    return str(make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param)))


def _engine(ckpt, **kw):
    return LLM(ckpt, memory_budget_bytes=16 << 20, max_num_batched_tokens=32, **kw)


def _finish(llm, ids):
    done = {}
    while llm.has_unfinished_requests():
        for o in llm.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    return [done[i] for i in ids]


@pytest.mark.parametrize("params", [greedy(16), SEEDED], ids=["greedy", "seeded"])
def test_migrate_mid_decode_in_process(ckpt, params):
    expected = [o.outputs[0].token_ids for o in _engine(ckpt).generate(PROMPTS, params, use_tqdm=False)]
    src, dst = _engine(ckpt), _engine(ckpt, block_size=32)  # another block size on the far side
    ids = [src.add_request(p, params) for p in PROMPTS]
    for _ in range(5):  # prefill (two chunks for the long prompt) and a few decodes
        src.step()
    snaps = [snapshot_from_bytes(snapshot_to_bytes(src.export_request(i))) for i in ids[:2]]
    assert snaps[0].num_computed_tokens > len(PROMPTS[0])  # mid-decode, KV and state included
    for s in snaps:
        dst.import_request(s)
    rest = _finish(src, ids[2:])
    moved = _finish(dst, ids[:2])
    assert moved + rest == expected
    assert src.stats()["migrations"]["out"] == 2 and dst.stats()["migrations"]["in"] == 2
    assert_no_leaks(src)
    assert_no_leaks(dst)


def test_import_refuses_another_model(ckpt, tmp_path):
    other = str(make_tiny_checkpoint("bamba", tmp_path / "other", seed=1))
    src = _engine(ckpt)
    rid = src.add_request(PROMPTS[0], greedy(8))
    src.step()
    snap = src.export_request(rid)
    with pytest.raises(SnapshotMismatchError, match="fingerprint"):
        _engine(other).import_request(snap)


WORKER = textwrap.dedent("""
    import os, sys, json
    import torch.distributed as dist
    from hybridkv import LLM, SamplingParams
    from hybridkv.scheduler.snapshot_io import send_snapshot, recv_snapshot
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    llm = LLM(sys.argv[1], memory_budget_bytes=16 << 20, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.8, top_k=30, seed=123, max_tokens=16, ignore_eos=True)
    if rank == 0:
        rid = llm.add_request(json.loads(sys.argv[2]), params, request_id="r")
        for _ in range(4):
            llm.step()
        send_snapshot(llm.export_request(rid), dst=1)
        s = llm.stats()
        assert s["kv_blocks_used"] == 0 and s["state_slots_live"] == 0, s
    else:
        llm.import_request(recv_snapshot(src=0))
        out = []
        while llm.has_unfinished_requests():
            out += [o for o in llm.step() if o.finished]
        print("TOKENS", json.dumps(out[0].outputs[0].token_ids))
    dist.destroy_process_group()
""")


@pytest.mark.slow  # two processes
def test_migrate_between_processes_over_gloo(ckpt, tmp_path):
    import json
    expected = _engine(ckpt).generate([PROMPTS[1]], SEEDED, use_tqdm=False)[0].outputs[0].token_ids
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000),
               WORLD_SIZE="2")
    procs = [subprocess.Popen([sys.executable, str(script), ckpt, json.dumps(PROMPTS[1])],
                              env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, e[-3000:]
    line = [ln for ln in outs[1][0].splitlines() if ln.startswith("TOKENS")][0]
    assert json.loads(line.split(" ", 1)[1]) == expected


def test_a_flipped_byte_in_transit_is_refused(ckpt):
    src = _engine(ckpt)
    rid = src.add_request(PROMPTS[0], greedy(8))
    src.step()
    data = bytearray(snapshot_to_bytes(src.export_request(rid)))
    assert snapshot_from_bytes(bytes(data)).req_id == rid
    data[len(data) // 2] ^= 0x10
    dst = _engine(ckpt)
    with pytest.raises(SnapshotMismatchError, match="corrupt"):
        dst.import_request(snapshot_from_bytes(bytes(data)))
    assert_no_leaks(dst)
