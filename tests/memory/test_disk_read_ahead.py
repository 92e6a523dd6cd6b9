"""The read-ahead rule and the reader thread (hybridkv/memory/disk_read_ahead.py, disk_reader.py)
behind HybridCacheManager: a waiting request's disk files are read on the reader thread and its
admission promotes them byte-exact without reading; bytes staged from an entry the store has since
dropped and rewritten are not used (read again on the step); a prefix the device got meanwhile
needs no read and frees what was staged; over the byte bound a job is refused and the admission
reads for itself; a request that leaves frees its bytes."""
import torch

from hybridkv.cache_manager import HybridCacheManager
from hybridkv.request import Request
from hybridkv.specs import AttentionSpec, RecurrentSpec
from tier_steps import computed_with_states, state_of

BS = 4
HYBRID = {0: RecurrentSpec((3, 2), (2, 4), torch.float32), 1: AttentionSpec(2, 4, torch.float32),
          2: AttentionSpec(1, 8, torch.float16)}
PROMPT = list(range(1, 14))  # 3 full blocks before the last token
BIG = 1 << 20  # host bytes: room for every state and block these tests make


OTHER = list(range(30, 43))


def manager(tmp_path):
    return HybridCacheManager(HYBRID, BS, 12, 4, fingerprint="f", checkpoint_policy="none", host_cache_bytes=BIG,
                              disk_cache_dir=str(tmp_path))


def restarted(tmp_path, *prompts):
    """A manager on a directory where an earlier one computed `prompts` (state at 12 each): {prompt
    index: (states, kv)} of them, and the new manager, which holds them on disk only."""
    first = manager(tmp_path)
    kept = {i: computed_with_states(first, p, i + 1) for i, p in enumerate(prompts)}
    first.close()
    return kept, manager(tmp_path)


def read_ahead(m, r) -> int:
    """Ask the rule for r until it lets r go, waiting for each job (a condition wait); the rounds held."""
    rounds = 0
    while m.prefix_cache.waits_for_disk_read(r):
        rounds += 1
        while m.disk.reader.busy(r.request_id):
            m.disk.reader.wait(30)
    return rounds


def hit_is(m, rid, states, kv):
    assert all(torch.equal(m.kv_caches[i][m.block_ids(rid)[:3]], kv[i]) for i in kv)
    assert all(torch.equal(a, b) for a, b in zip(state_of(m, m.live_slot(rid)), states[12]))


def test_the_admission_promotes_what_the_reader_read_without_a_read(tmp_path):
    kept, m = restarted(tmp_path, PROMPT)
    r = Request("a", PROMPT + [50])
    assert read_ahead(m, r) == 1
    assert m.disk.store.stats()["reads"] == 4 and m.disk.reader.counters.reads == 4  # all on the reader thread
    assert m.admit(r) == 12
    hit_is(m, "a", *kept[0])
    disk = m.stats().tiers["disk"]
    assert disk["sync_reads"] == 0 and disk["background_reads"] == 4 and m.disk.store.stats()["reads"] == 4, disk
    assert disk["promotions"] == 1 and disk["kv_promotions"] == 3 and m.disk.reader.staged_bytes == 0
    m.finish("a")
    m.close()


def test_bytes_staged_from_an_entry_since_rewritten_are_read_again(tmp_path):
    kept, m = restarted(tmp_path, PROMPT)
    r = Request("a", PROMPT + [50])
    read_ahead(m, r)
    key = m.prefix_cache.prompt_hashes(PROMPT, None)[2]
    name = m.disk.state_name(key, 12)
    staged = m.disk.reader.staged("a")[name].tensors
    m.disk.store.remove(name)  # (the guard's invalidation), then the same entry written again
    assert m.disk.store.put(name, "state", key, 12, [(k, t.clone()) for k, t in staged.items()])
    m.disk.flush()
    assert m.admit(r) == 12
    hit_is(m, "a", *kept[0])
    assert m.stats().tiers["disk"]["sync_reads"] == 1  # the state read on the step; the 3 blocks were staged
    m.finish("a")
    m.close()


def test_a_prefix_the_device_got_meanwhile_needs_no_read_and_frees_the_staged_bytes(tmp_path):
    kept, m = restarted(tmp_path, PROMPT)
    a = Request("a", PROMPT + [50])
    read_ahead(m, a)
    assert m.disk.reader.staged_bytes > 0
    assert m.admit(Request("b", PROMPT + [60])) == 12  # b is not read ahead: its admission reads the files
    assert m.stats().tiers["disk"]["sync_reads"] == 4
    assert not m.prefix_cache.waits_for_disk_read(a) and m.disk.reader.staged_bytes == 0
    assert m.admit(a) == 12  # the device's own hit
    hit_is(m, "a", *kept[0])
    assert m.stats().tiers["disk"]["sync_reads"] == 4
    m.finish("a")
    m.finish("b")
    m.close()


def test_over_the_byte_bound_a_job_is_refused_and_the_admission_reads_itself(tmp_path):
    kept, m = restarted(tmp_path, PROMPT, OTHER + [7])
    m.disk.reader.max_bytes = 1  # one job alone still runs; a second one is refused
    a, b = Request("a", PROMPT + [50]), Request("b", OTHER + [7, 50])
    assert m.prefix_cache.waits_for_disk_read(a)
    assert not m.prefix_cache.waits_for_disk_read(b)  # over the bound: not held
    assert m.disk.reader.counters.over_bound == 1
    assert m.admit(b) == 12 and m.stats().tiers["disk"]["sync_reads"] == 4
    hit_is(m, "b", *kept[1])
    while m.disk.reader.busy("a"):
        m.disk.reader.wait(30)
    m.prefix_cache.forget_disk_read("a")  # a leaves before its admission: its bytes are freed
    assert m.disk.reader.staged_bytes == 0 and m.disk.reader.staged("a") == {}
    m.finish("b")
    m.close()
