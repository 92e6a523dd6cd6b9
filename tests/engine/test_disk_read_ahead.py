"""Disk reads off the engine step (hybridkv/memory/disk_reader.py, memory/disk_read_ahead.py) through
the engine: a restarted engine's hits read their files on the reader thread (counted), with the
no-cache engine's tokens and nothing leaked, and with `disk_read_ahead=False` the same hits read
on the step's thread; a damaged file read ahead is refused, counted and deleted, and the request
admitted at the shallower position that still hits; a request whose reads are in flight is held
while another is scheduled and decodes (the reader stopped at a gate, no sleeping)."""
import threading
from pathlib import Path

import pytest

from engine_fixtures import assert_no_leaks, greedy, three_block_prompts, tokens_and_cached
from hybridkv import LLM
from hybridkv.models.tiny import make_tiny_checkpoint

KW = dict(memory_budget_bytes=16 << 20, max_num_seqs=4)
READER = "hybridkv-disk-reader"  # the reader thread's name


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    return make_tiny_checkpoint("bamba", tmp_path_factory.mktemp("bamba"), seed=0)


def oracle(path, ps):
    return tokens_and_cached(LLM(str(path), enable_prefix_caching=False, **KW), ps)[0]


def write_first(path, root, ps, **kw):
    """A first engine answers `ps` on a disk tier at `root`, and is closed (every write done)."""
    llm = LLM(str(path), disk_cache_dir=str(root), **KW, **kw)
    assert tokens_and_cached(llm, ps)[1] == [0] * len(ps)
    llm.close()


def no_leaks(llm):
    assert_no_leaks(llm)
    reader = llm.manager.disk.reader
    assert reader is None or reader.staged_bytes == 0 and not reader.in_flight()


def readers() -> int:
    return sum(t.name == READER for t in threading.enumerate())


@pytest.mark.parametrize("read_ahead", [True, False], ids=["read_ahead", "on_the_step"])
def test_a_restart_reads_its_hits_off_the_step(bamba, tmp_path, read_ahead):
    ps = three_block_prompts()
    want = oracle(bamba, ps)
    write_first(bamba, tmp_path, ps)
    again = LLM(str(bamba), disk_cache_dir=str(tmp_path), disk_read_ahead=read_ahead, **KW)
    got, cached = tokens_and_cached(again, ps)
    assert got == want and cached == [48, 48, 48], cached
    disk = again.stats()["checkpoint_tiers"]["disk"]
    files = 3 * (3 + 1)  # each prompt's 3 KV blocks and its state
    assert disk["hits"] == 3 and disk["kv_promotions"] == 9 and disk["promotions"] == 3, disk
    if read_ahead:
        assert disk["background_reads"] == files and disk["sync_reads"] == 0, disk
        assert disk["read_wait_seconds"] > 0, disk
    else:
        assert again.manager.disk.reader is None
        assert disk["background_reads"] == 0 and disk["sync_reads"] == files and disk["read_wait_seconds"] == 0, disk
    no_leaks(again)
    before = readers()
    again.close()
    assert readers() == before - read_ahead  # close() stopped the reader


def test_a_damaged_file_read_ahead_is_refused_and_a_shallower_hit_taken(bamba, tmp_path):
    """States are kept at every block boundary (16, 32, 48); the first prompt's state at 48 is
    bit-flipped. Its read ahead refuses it (counted, deleted); the position is then 32, whose state
    the reader reads in a second round, so the admission reads nothing itself and hits 32; the
    recomputed prefix writes the state at 48 afresh."""
    ps, kw = three_block_prompts(), dict(checkpoint_policy="every_n_blocks", checkpoint_every_n=1)
    want = oracle(bamba, ps)
    write_first(bamba, tmp_path, ps, **kw)
    again = LLM(str(bamba), disk_cache_dir=str(tmp_path), **KW, **kw)
    disk = again.manager.disk
    key = again.manager.prefix_cache.prompt_hashes(ps[0], None)[2]
    damaged = Path(disk.store.dir) / disk.state_name(key, 48)
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))
    got, cached = tokens_and_cached(again, ps)
    assert got == want and cached == [32, 48, 48], cached
    s = again.stats()["checkpoint_tiers"]["disk"]
    assert s["refused_corrupt"] == 1 and s["background_reads"] == 4 + 1 + 4 + 4 and s["sync_reads"] == 0, s
    no_leaks(again)
    again.close()
    assert damaged.read_bytes() != bytes(data)  # deleted, and written afresh as the prefix was recomputed


def test_a_request_is_held_while_its_reads_are_in_flight_and_others_run(bamba, tmp_path, monkeypatch):
    """The reader stops at a gate inside its first file read: the request whose hit needs the disk
    stays waiting step after step while a request needing no disk is admitted and decodes; once
    the gate opens and the reads are done, the held request is admitted at 48 from the staged
    bytes (no read on the step's thread), and both answer as the no-cache engine."""
    ps, fresh = three_block_prompts(1), three_block_prompts(1, seed=7)[0]
    want = oracle(bamba, [ps[0], fresh])
    write_first(bamba, tmp_path, ps)
    llm = LLM(str(bamba), disk_cache_dir=str(tmp_path), **KW)
    store, reader = llm.manager.disk.store, llm.manager.disk.reader
    gate, at_gate, read = threading.Event(), threading.Event(), store.read

    def gated_read(*args, **kw):
        if threading.current_thread().name == READER:
            at_gate.set()
            assert gate.wait(60), "the test never opened the gate"
        return read(*args, **kw)

    monkeypatch.setattr(store, "read", gated_read)
    llm.add_request(ps[0], greedy(6), request_id="disk")
    llm.add_request(fresh, greedy(6), request_id="fresh")
    outs = {}
    for step in range(4):
        for o in llm.step():
            outs[o.request_id] = o
        assert at_gate.wait(60)
        status = {q.request_id: q.status for q in llm.queued()}
        assert status == {"disk": "waiting", "fresh": "running"}, (step, status)
        assert reader.busy("disk")
    assert len(outs["fresh"].outputs[0].token_ids) >= 2  # it decoded while the other was held
    gate.set()
    while reader.busy("disk"):  # the job ends (a condition wait, not a sleep)
        reader.wait(60)
    while llm.has_unfinished_requests():
        for o in llm.step():
            outs[o.request_id] = o
    assert outs["disk"].num_cached_tokens == 48 and outs["fresh"].num_cached_tokens == 0
    assert [outs["disk"].outputs[0].token_ids, outs["fresh"].outputs[0].token_ids] == want
    s = llm.stats()["checkpoint_tiers"]["disk"]
    assert s["background_reads"] == 4 and s["sync_reads"] == 0 and s["read_wait_seconds"] > 0, s
    no_leaks(llm)
    llm.close()
