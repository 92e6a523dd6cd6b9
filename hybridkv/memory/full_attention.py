"""Full-attention KV: paged blocks shared by refcount, found by hash, copied on write.

Every attention layer of the kind uses the same block ids (`kv[layer][block]`). A request's
blocks cover [0, num_computed_tokens) plus whatever it allocated past that. A block that fills
up gets its chained hash and stays findable after release, until the pool hands it out again
(LRU). A partial block shared by a fork is copied before the first write into it.
SlidingWindowMemory (sliding_window.py) is this kind with blocks that leave the window freed.
"""
from __future__ import annotations

from typing import Hashable, Mapping, Optional, Sequence

import numpy as np
import torch

from hybridkv.block_pool import BlockPool
from hybridkv.block_table import BlockTables
from hybridkv.errors import SnapshotMismatchError
from hybridkv.specs import AttentionSpec
from hybridkv.kv_tokens import blocks_from_tokens, kv_tokens

from .layer_memory import LayerMemory

NO_BLOCK = -1  # a table position whose block was let go (it left the sliding window)


class FullAttentionMemory(LayerMemory):
    """Paged KV `kv[layer] : [num_blocks, parts, block_size, kv_heads, head_dim]` for full attention
    (parts 2: key and value; 1: a latent per token, same block bookkeeping, see AttentionSpec)."""

    name = "full_attention"

    @staticmethod
    def handles(spec) -> bool:
        return isinstance(spec, AttentionSpec) and spec.sliding_window is None

    def __init__(self, layers: Mapping[int, AttentionSpec], block_size: int, num_blocks: int,
                 device: torch.device | str = "cpu"):
        super().__init__(layers, block_size)
        self.pool = BlockPool(self.layers, num_blocks, block_size, device)
        self.tables = BlockTables()
        self._blocks: dict[Hashable, list[int]] = {}
        self._row: dict[Hashable, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def block_ids(self, rid: Hashable) -> list[int]:
        """rid's block per table position (NO_BLOCK where one was let go); [] when it holds none."""
        return self._blocks.get(rid, [])

    def held_blocks(self, rid: Hashable) -> list[int]:
        return [b for b in self._blocks.get(rid, ()) if b != NO_BLOCK]

    def first_needed_token(self, position: int) -> int:
        """The first key the token at `position` attends to (full attention: 0)."""
        return 0

    def first_needed_block(self, position: int) -> int:
        return self.first_needed_token(position) // self.block_size

    # ---- prefix reuse ----------------------------------------------------------------------
    def usable_prefix(self, hashes: Sequence[bytes], limit: int) -> int:
        cached = self.pool.cached
        for m in range(min(limit, len(hashes))):
            if hashes[m] not in cached:
                return m
        return min(limit, len(hashes))

    def is_cached(self, h: bytes) -> bool:
        return h in self.pool.cached

    def parent_hash(self, h: bytes) -> Optional[bytes]:
        """The hash of the block before the cached block keyed h (None: not cached, or the first)."""
        b = self.pool.cached.get(h)
        return None if b is None else self.pool.parent[b]

    def num_children(self, h: bytes) -> int:
        return len(self.pool.children.get(h, ()))

    def branches(self, hashes: Sequence[bytes], k: int) -> bool:
        return 0 < k < len(hashes) and self.pool.has_other_child(hashes[k - 1], hashes[k])

    # ---- admission and the step ------------------------------------------------------------
    def never_fits(self, num_tokens: int) -> Optional[str]:
        need = self._blocks_to_hold(num_tokens)
        if need > self.num_blocks:
            return (f"needs {need} KV blocks of {self.block_size} tokens but the {self.name} pool has "
                    f"{self.num_blocks}")
        return None

    def _blocks_to_hold(self, num_tokens: int) -> int:
        """The most blocks one request of num_tokens ever holds at once."""
        return -(-num_tokens // self.block_size)

    def _hit_blocks(self, hashes: Sequence[bytes], hit: int) -> list[int]:
        """The cached blocks a hit after `hit` blocks takes (those the next token attends to)."""
        first = self.first_needed_block(hit * self.block_size)
        return [self.pool.cached[h] for h in hashes[first:hit]]

    def can_admit(self, hashes: Sequence[bytes], hit: int, end: int) -> bool:
        revived = sum(1 for b in self._hit_blocks(hashes, hit) if self.pool.refcount[b] == 0)
        first = self.first_needed_block(hit * self.block_size)
        new = max(0, -(-end // self.block_size) - max(hit, first))
        return self.pool.num_free - revived >= new

    def admit(self, rid: Hashable, hashes: Sequence[bytes], hit: int) -> None:
        first = self.first_needed_block(hit * self.block_size)
        blocks = self._hit_blocks(hashes, hit)
        self.pool.ref(blocks)
        self._place(rid, [NO_BLOCK] * min(first, hit) + blocks)

    def _place(self, rid: Hashable, blocks: list[int]) -> None:
        self._blocks[rid] = blocks
        self._row[rid] = row = self.tables.new_row()
        self.tables.write(row, 0, [max(b, 0) for b in blocks])  # let-go positions read block 0, masked

    def _missing(self, rid: Hashable, start: int, end: int) -> tuple[int, bool]:
        """(blocks to add for [start, end), whether the partial block at start must be copied)."""
        bs, blocks = self.block_size, self._blocks[rid]
        need = max(0, -(-end // bs) - len(blocks))
        cow = bool(start % bs) and start // bs < len(blocks) and self.pool.refcount[blocks[start // bs]] > 1
        return need, cow

    def _has_room(self, rid: Hashable, start: int, end: int) -> bool:
        """[start, end) lies in rid's blocks and none it writes is shared: nothing to add or copy
        (most decodes; the same answer as _missing's (0, False), without building it)."""
        blocks, bs = self._blocks[rid], self.block_size
        return end <= len(blocks) * bs and (not start % bs or self.pool.refcount[blocks[start // bs]] <= 1)

    def can_allocate(self, rid: Hashable, start: int, end: int) -> bool:
        if self._has_room(rid, start, end):
            return True
        need, cow = self._missing(rid, start, end)
        return need + cow <= self.pool.num_free

    def allocate(self, rid: Hashable, start: int, end: int) -> None:
        if self._has_room(rid, start, end):
            return
        need, cow = self._missing(rid, start, end)
        if not need and not cow:
            return
        bs, blocks, row = self.block_size, self._blocks[rid], self._row[rid]
        new = self.pool.allocate(need + cow)
        if new is None:
            raise RuntimeError(f"allocate for {rid!r} without room: call can_allocate first")
        if cow:  # never write a shared block: this request gets its own copy of the partial block
            i, fresh = start // bs, new.pop()
            self.pool.copy_block(blocks[i], fresh)
            self.pool.release([blocks[i]])
            blocks[i] = fresh
            self.tables.write(row, i, [fresh])
        if new:
            self.tables.write(row, len(blocks), new)
            blocks.extend(new)

    def trim(self, rid: Hashable, num_tokens: int) -> None:
        blocks = self._blocks[rid]
        keep = -(-num_tokens // self.block_size)
        if len(blocks) > keep:  # blocks past the last kept token: fresh, unhashed, this request's alone
            extra = blocks[keep:]
            del blocks[keep:]
            self.pool.release(extra)

    def table_row(self, rid: Hashable) -> int:
        """rid's row in `tables`."""
        return self._row[rid]

    def decode_room(self, rows: np.ndarray, held: np.ndarray, alone: np.ndarray, starts: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
        """One token at position starts[i] for the request with table row rows[i] holding held[i]
        table positions (int64 arrays, decode_rows.py): arrays of (its KV write slot, -1 past the
        blocks it holds; whether it lands in a block it holds alone: nothing to add or copy, the
        batched `_has_room`). alone[i]: the table position whose block the request is known to hold
        alone (-1: none); the blocks found alone here are recorded in it."""
        bs, table = self.block_size, self.tables.array
        col, off = np.divmod(starts, bs)
        inside = col < held
        block = table[rows, np.minimum(col, table.shape[1] - 1)].astype(np.int64)
        room = inside.copy()
        # a fork's shared partial block is copied first; a block once alone stays so while the
        # request decodes (only full, hashed blocks are found by others)
        unknown = np.flatnonzero(inside & (off != 0) & (col != alone))
        if unknown.size:
            refcount = np.fromiter(map(self.pool.refcount.__getitem__, block[unknown].tolist()), np.int64,
                                   unknown.size)
            room[unknown] = refcount <= 1
            found = unknown[refcount <= 1]
            alone[found] = col[found]
        return np.where(inside, block * bs + off, -1), room

    def add_decode_blocks(self, rids: list, rows: np.ndarray, cols: np.ndarray) -> list[int]:
        """One new block for each of rids, at table position cols[i] (its next; rows[i]: its table
        row): the batched allocate() of decodes that start a block; returns them. The pool must
        have them."""
        new = self.pool.allocate(len(rids))
        if new is None:
            raise RuntimeError(f"add_decode_blocks: {len(rids)} blocks wanted, {self.pool.num_free} free")
        self.tables.ensure_cols(int(cols.max()) + 1)
        self.tables.array[rows, cols] = new
        for blocks, b in zip(map(self._blocks.__getitem__, rids), new):
            blocks.append(b)
        return new

    def slot_mapping(self, rid: Hashable, start: int, end: int) -> list[int]:
        """KV write slots `block * block_size + pos % block_size` for positions [start, end)."""
        bs, row = self.block_size, self.tables.array[self._row[rid]]
        if end - start == 1:
            return [int(row[start // bs]) * bs + start % bs]
        pos = np.arange(start, end)
        return (row[pos // bs].astype(np.int64) * bs + pos % bs).tolist()

    def block_table(self, rids: Sequence[Hashable], width: Optional[int] = None) -> torch.Tensor:
        """int32 `[len(rids), width]` of block ids; width defaults to the longest table."""
        if width is None:
            width = max(map(len, map(self._blocks.__getitem__, rids)), default=1)
        return self.tables.gather(list(map(self._row.__getitem__, rids)), width)

    decode_commit_always_idle = True  # commit changes something only when a block fills (its hash)

    def decode_commit_idle(self, num_computed: np.ndarray) -> np.ndarray | bool:
        return True

    def commit(self, rid: Hashable, hashes: Sequence[bytes], num_hashed: int, num_full: int,
               num_computed: int) -> None:
        blocks = self._blocks[rid]
        for i in range(num_hashed, num_full):
            if blocks[i] != NO_BLOCK:
                self.pool.set_hash(blocks[i], hashes[i], hashes[i - 1] if i else b"")

    def mark_boundary(self, rid: Hashable, index: int, h: bytes) -> None:
        # re-register in case an evicted twin answered for this hash
        b = self._blocks[rid][index]
        if b != NO_BLOCK:
            self.pool.set_hash(b, h)

    # ---- a request's life ------------------------------------------------------------------
    def fork(self, parent: Hashable, child: Hashable, num_computed: int) -> None:
        shared = self._blocks[parent][: -(-num_computed // self.block_size)]
        self.pool.ref([b for b in shared if b != NO_BLOCK])
        self._place(child, list(shared))

    def release(self, rid: Hashable, donate: Optional[tuple[bytes, int]] = None) -> None:
        blocks = self._blocks.pop(rid, None)
        if blocks is None:
            return
        self.pool.release([b for b in blocks if b != NO_BLOCK])
        self.tables.free_row(self._row.pop(rid))

    def _computed_blocks(self, rid: Hashable, num_computed: int) -> tuple[int, list[int]]:
        """(first held block index, held blocks) covering [0, num_computed)."""
        blocks = self._blocks[rid][: -(-num_computed // self.block_size)]
        first = next((i for i, b in enumerate(blocks) if b != NO_BLOCK), len(blocks))
        return first, blocks[first:]

    def swap_bytes(self, rid: Hashable, num_computed: int) -> int:
        held = self._computed_blocks(rid, num_computed)[1]
        return len(held) * sum(t[0].numel() * t.element_size() for t in self.pool.kv.values())

    def swap_out(self, rid: Hashable, num_computed: int) -> dict:
        first, held = self._computed_blocks(rid, num_computed)
        pin = self.pool._device.type == "cuda"
        copy = {"first": first, "kv": self.pool.gather(held, "cpu", pin) if held else {}, "n": len(held)}
        self.release(rid)
        return copy

    def _room(self, first: int, n: int, end: int) -> int:
        """Blocks needed to hold n blocks from index `first` and grow them to cover [.., end)."""
        return max(first + n, -(-end // self.block_size)) - first

    def can_swap_in(self, copy: dict, end: int) -> bool:
        return self.pool.num_free >= self._room(copy["first"], copy["n"], end)

    def swap_in(self, rid: Hashable, copy: dict, hashes: Sequence[bytes], num_computed: int) -> None:
        new = self.pool.allocate(copy["n"]) if copy["n"] else []
        if new:
            self.pool.scatter(new, copy["kv"])
        self._place(rid, [NO_BLOCK] * copy["first"] + new)
        self.commit(rid, hashes, 0, min(len(hashes), num_computed // self.block_size), num_computed)

    def export(self, rid: Hashable, num_computed: int, device: torch.device | str) -> dict:
        first, held = self._computed_blocks(rid, num_computed)
        start = first * self.block_size
        kv = kv_tokens(self.pool, held, num_computed - start, device)
        return {"kv": kv, "kv_start": {i: start for i in kv} if start else {}}

    def _import_layout(self, part: dict, num_computed: int) -> tuple[int, int, int]:
        """(first block index here, blocks to fill, tokens of padding before the exported start)."""
        starts = part.get("kv_start", {})
        start = min((starts.get(i, 0) for i in self.layers), default=0)  # this group's layers only
        start = max(start, self.first_needed_block(num_computed) * self.block_size)
        first = start // self.block_size
        n = -(-num_computed // self.block_size) - first
        return first, max(0, n), start

    def check_import(self, part: dict, num_computed: int) -> None:
        kv, starts = part.get("kv", {}), part.get("kv_start", {})
        needed = self.first_needed_token(num_computed)
        for i, s in self.layers.items():
            start = starts.get(i, 0)
            vector, dtype = s.stored_vector()
            want = (s.kv_parts, num_computed - start, s.num_kv_heads, *vector)
            t = kv.get(i)
            if t is None:
                raise SnapshotMismatchError(f"snapshot has no KV for attention layer {i}")
            if not 0 <= start <= needed:
                raise SnapshotMismatchError(
                    f"snapshot KV of layer {i} starts at token {start}; the next token needs keys from {needed}")
            if tuple(t.shape) != want or t.dtype != dtype:
                raise SnapshotMismatchError(
                    f"snapshot KV of layer {i} is {tuple(t.shape)} {t.dtype}; expected {want} {dtype}")
            if not bool(torch.isfinite(t if s.layout is None else s.layout.decode(t)).all()):
                raise SnapshotMismatchError(f"snapshot KV of layer {i} holds NaN or infinite values")

    def can_import(self, part: dict, num_computed: int, end: int) -> bool:
        first, n, _ = self._import_layout(part, num_computed)
        return self.pool.num_free >= self._room(first, n, end)

    def import_(self, rid: Hashable, part: dict, hashes: Sequence[bytes], num_computed: int) -> None:
        first, n, start = self._import_layout(part, num_computed)
        new = self.pool.allocate(n) if n else []
        if new:
            tokens = {}
            for i, t in part["kv"].items():  # t: [parts, T, h, d] starting at the exporter's kv_start
                lo = start - part.get("kv_start", {}).get(i, 0)
                t = t[:, lo:]
                pad = t.new_zeros((t.shape[0], start - first * self.block_size, *t.shape[2:]))
                tokens[i] = torch.cat([pad, t], dim=1)
            self.pool.scatter(new, blocks_from_tokens(tokens, self.block_size))
        self._place(rid, [NO_BLOCK] * first + new)
        self.commit(rid, hashes, 0, min(len(hashes), num_computed // self.block_size), num_computed)

    def layer_shapes(self) -> dict[int, tuple]:
        return {i: ("attn", s.num_kv_heads, s.head_dim, str(s.dtype)) + (("latent",) if s.latent else ())
                + (("cache", s.cache_dtype) if s.cache_dtype else ()) for i, s in self.layers.items()}

    def stats(self) -> dict:
        p = self.pool
        return {"blocks_used": p.num_blocks - p.num_free, "blocks_cached": p.num_cached_free,
                "blocks_free": p.num_free, "blocks_total": p.num_blocks}
