"""The disk tier's files (hybridkv/memory/disk_store.py, disk_format.py): a round trip is byte-exact
for every dtype; writes are atomic (a failed write leaves no file, a crashed one's temporary file
is cleaned at the next start); a truncated, bit-flipped, renamed or re-shaped file is refused,
counted and deleted; the budget evicts the least recently used; a new store finds the old files."""
import os
import time

import pytest
import torch

from hybridkv.memory import disk_store
from hybridkv.memory.disk_format import DiskEntryError, decode, layout_of
from hybridkv.memory.disk_store import DiskStore

KEY, OTHER = bytes(range(32)), bytes(range(1, 33))


def tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"kv.0": torch.randn(2, 4, 2, 8, generator=g),
            "kv.1": torch.randn(2, 4, 2, 8, generator=g).to(torch.bfloat16),
            "codes": torch.randint(0, 256, (3, 36), dtype=torch.uint8, generator=g),  # a quantized pool's bytes
            "empty": torch.zeros(0, dtype=torch.float16)}


def bytes_of(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def put(store, name, ts=None, key=KEY, position=16):
    ts = tensors() if ts is None else ts
    assert store.put(name, "kv", key, position, list(ts.items()))
    return ts


def read(store, name, ts, key=KEY, position=16):
    return store.read(name, "kv", key, position, layout_of(ts))


@pytest.fixture
def store(tmp_path):
    s = DiskStore(tmp_path, "ns", 1 << 20)
    yield s
    s.close()


def test_round_trip_is_byte_exact_and_atomic(store, tmp_path):
    ts = put(store, "a.hkv")
    store.flush()
    got = read(store, "a.hkv", ts)
    assert list(got) == list(ts)
    for name, t in ts.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert torch.equal(bytes_of(got[name]), bytes_of(t)), name
    # only the final name is left: the temporary file was renamed over it
    assert sorted(os.listdir(tmp_path / "ns")) == ["a.hkv"]
    assert store.stats()["writes"] == 1 and store.stats()["reads"] == 1


def test_a_failed_write_leaves_no_file(store, tmp_path, monkeypatch):
    def no_space(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(disk_store.os, "fsync", no_space)
    put(store, "a.hkv")
    store.flush()
    assert os.listdir(tmp_path / "ns") == [] and not store.has("a.hkv")
    s = store.stats()
    assert s["write_errors"] == 1 and s["writes"] == 0 and s["bytes"] == 0, s


def test_a_crashed_writers_temporary_file_is_removed_at_start(tmp_path):
    d = tmp_path / "ns"
    d.mkdir()
    stale, fresh = d / ".tmp-1-2-x.hkv", d / ".tmp-3-4-y.hkv"
    stale.write_bytes(b"half an entry")
    fresh.write_bytes(b"another process is writing this one")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    s = DiskStore(tmp_path, "ns", 1 << 20)
    s.close()
    assert not stale.exists() and fresh.exists()
    assert len(s) == 0  # neither is an entry


def corrupt_truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def corrupt_flip(offset):
    def flip(path):
        data = bytearray(path.read_bytes())
        data[offset % len(data)] ^= 0x10
        path.write_bytes(bytes(data))
    return flip


@pytest.mark.parametrize("corrupt", [corrupt_truncate, corrupt_flip(3), corrupt_flip(20), corrupt_flip(-40),
                                     corrupt_flip(-2), lambda p: p.write_bytes(b"")],
                         ids=["truncated", "flip-magic", "flip-header", "flip-payload", "flip-crc", "empty"])
def test_a_damaged_file_is_refused_counted_and_deleted(store, tmp_path, corrupt):
    ts = put(store, "a.hkv")
    store.flush()
    corrupt(tmp_path / "ns" / "a.hkv")
    assert read(store, "a.hkv", ts) is None
    assert store.stats()["refused_corrupt"] == 1
    assert not (tmp_path / "ns" / "a.hkv").exists() and not store.has("a.hkv")
    assert read(store, "a.hkv", ts) is None and store.stats()["refused_corrupt"] == 1  # now a plain miss


def test_a_file_under_another_key_position_or_layout_is_refused(store, tmp_path):
    ts = put(store, "a.hkv")
    store.flush()
    data = bytearray((tmp_path / "ns" / "a.hkv").read_bytes())
    layout = layout_of(ts)
    assert set(decode(data, "kv", KEY, 16, "ns", layout)) == set(ts)
    wrong = [(("kv", OTHER, 16, "ns", layout), "key"), (("kv", KEY, 32, "ns", layout), "position"),
             (("state", KEY, 16, "ns", layout), "kind"), (("kv", KEY, 16, "other", layout), "namespace"),
             (("kv", KEY, 16, "ns", [(n, torch.float16 if n == "kv.0" else d, s) for n, d, s in layout]), "tensors"),
             (("kv", KEY, 16, "ns", [(n, d, (1,) + s if n == "kv.0" else s) for n, d, s in layout]), "tensors")]
    for args, why in wrong:
        with pytest.raises(DiskEntryError, match=why if why == "tensors" else "expected"):
            decode(data, *args)
    # the store refuses a file found under another entry's name (a renamed file)
    os.replace(tmp_path / "ns" / "a.hkv", tmp_path / "ns" / "b.hkv")
    store2 = DiskStore(tmp_path, "ns", 1 << 20)
    try:
        assert store2.read("b.hkv", "kv", OTHER, 16, layout) is None
        assert store2.stats()["refused_corrupt"] == 1 and not store2.has("b.hkv")
    finally:
        store2.close()


def test_the_budget_evicts_the_least_recently_used(tmp_path):
    one = sum(t.numel() * t.element_size() for t in tensors().values()) + 512
    s = DiskStore(tmp_path, "ns", 2 * one + 10)
    try:
        ts = put(s, "a.hkv")
        put(s, "b.hkv")
        s.flush()
        assert read(s, "a.hkv", ts) is not None  # a is used: b is now the least recently used
        put(s, "c.hkv")
        s.flush()
        assert sorted(os.listdir(tmp_path / "ns")) == ["a.hkv", "c.hkv"]
        st = s.stats()
        assert st["evictions"] == 1 and st["bytes"] <= st["budget_bytes"] and st["files"] == 2, st
        assert not s.put("huge.hkv", "kv", KEY, 16, [("x", torch.zeros(3 * one, dtype=torch.uint8))])
    finally:
        s.close()


def test_a_new_store_finds_the_files_and_keeps_the_budget(tmp_path):
    s = DiskStore(tmp_path, "ns", 1 << 20)
    ts = put(s, "a.hkv")
    put(s, "b.hkv", tensors(1))
    s.close()
    size = os.path.getsize(tmp_path / "ns" / "a.hkv")
    again = DiskStore(tmp_path, "ns", 1 << 20)
    try:
        assert again.has("a.hkv") and again.has("b.hkv") and again.stats()["bytes"] == 2 * size
        assert torch.equal(bytes_of(read(again, "a.hkv", ts)["kv.1"]), bytes_of(ts["kv.1"]))
    finally:
        again.close()
    small = DiskStore(tmp_path, "ns", size + 1)  # a smaller budget at start evicts the oldest
    small.close()
    assert small.stats()["files"] == 1 and small.stats()["evictions"] == 1


def test_bad_arguments_say_what_to_do(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    with pytest.raises(ValueError, match=f"disk_cache_dir '{f}': cannot create and write .*pass a directory"):
        DiskStore(str(f), "ns", 1 << 20)
    with pytest.raises(ValueError, match="positive integer"):
        DiskStore(tmp_path, "ns", 0)
