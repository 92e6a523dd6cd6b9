"""Physical KV blocks: one block id addresses the same block in every attention layer's tensor.

The pool knows nothing of requests: it keeps refcounts, a content hash per block, the
hash -> block map of the prefix cache, and an LRU queue of free blocks in which a freed block
keeps its hash (and stays findable) until it is handed out again.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from itertools import islice
from typing import Mapping, Optional, Sequence

import torch

from hybridkv.layer_loads import Charge, LayerLoads
from hybridkv.specs import AttentionSpec


def _pages(s: AttentionSpec, num_blocks: int, block_size: int, device) -> torch.Tensor:
    """A layer's pages: `[num_blocks, parts, block_size, kv_heads, head_dim]` of its dtype, or under a
    quantized cache dtype `[..., kv_heads, layout.nbytes]` uint8 (codes and a scale per vector)."""
    lead = (num_blocks, s.kv_parts, block_size, s.num_kv_heads)
    if s.layout is not None:
        return s.layout.empty(lead, device)
    return torch.zeros(*lead, s.head_dim, dtype=s.dtype, device=device)


class BlockPool:
    """KV tensors `kv[layer] : [num_blocks, parts, block_size, kv_heads, head_dim]` plus block
    bookkeeping; parts = `AttentionSpec.kv_parts` (2: key and value, 1: a latent). A layer under a
    quantized cache dtype keeps `[..., kv_heads, nbytes]` uint8 instead (`_pages`).

    `mirror` (None unless tensor-parallel: hybridkv/parallel/pool_mirror.py) is told of every data
    move: `copied(src, dst)`; `gathered(blocks, mine, device, pin)` turns this pool's copy into
    every rank's heads; `scattered(blocks, data)` takes every rank's and returns this pool's.
    """

    def __init__(self, specs: Mapping[int, AttentionSpec], num_blocks: int, block_size: int,
                 device: torch.device | str = "cpu"):
        self.block_size = block_size
        self.num_blocks = num_blocks if specs else 0
        self.kv: dict[int, torch.Tensor] = {i: _pages(s, self.num_blocks, block_size, device) for i, s in specs.items()}
        self.refcount: list[int] = [0] * self.num_blocks
        self.block_hash: list[Optional[bytes]] = [None] * self.num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> the one block that answers for it
        # The prefix tree's branching: parent hash -> hashes of cached blocks that continue it.
        self.parent: list[Optional[bytes]] = [None] * self.num_blocks
        self.children: dict[bytes, set[bytes]] = {}
        # Free blocks, least recently useful first; popping the front evicts its hash.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(self.num_blocks))
        # Pinned turns (prefix_cache.pin): block -> monotonic deadline; a free pinned block is taken
        # only when no unpinned free block is left (a running request needs the memory)
        self.pinned_until: dict[int, float] = {}
        self.pins_reclaimed = 0  # pinned blocks taken before their deadline
        self.mirror = None
        self.loads = LayerLoads(device)  # writes from the host, layer by layer (hybridkv/layer_loads.py)
        # the host KV tier of this pool (memory/host_kv_tier.py; None: none): told of the cached
        # blocks an allocation evicts, before their new owner writes them (`evicting([(block, hash,
        # parent hash)])`), and of each hash a device block answers for again (`superseded(hash)`)
        self.host_kv = None

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still answer a prefix lookup (refcount 0, hash still mapped)."""
        return sum(1 for b in self.free if self.block_hash[b] is not None and self.cached.get(self.block_hash[b]) == b)

    def allocate(self, n: int) -> Optional[list[int]]:
        """Take `n` blocks with refcount 1 from the LRU front, evicting their hashes; None if fewer are free."""
        if n > len(self.free):
            return None
        free, refcount, block_hash, out = self.free, self.refcount, self.block_hash, []
        reclaimed = self._unpinned_first(n) if self.pinned_until else {}
        evicted = [] if self.host_kv is not None else None
        for _ in range(n):
            b = free.popitem(last=False)[0]
            h = block_hash[b]
            if h is not None:  # a cached block: its hash goes
                if evicted is not None and self.cached.get(h) == b:
                    evicted.append((b, h, self.parent[b], reclaimed.get(b, 0.0)))
                self._drop_hash(b)
            refcount[b] = 1
            out.append(b)
        kept = self.host_kv.evicting(evicted) if evicted else 0  # pinned blocks the host took, pins and all
        self.pins_reclaimed += len(reclaimed) - kept
        return out

    def pin(self, blocks: Sequence[int], until: float) -> None:
        """Keep `blocks` findable until the monotonic time `until` (unless memory runs out)."""
        for b in blocks:
            self.pinned_until[b] = max(until, self.pinned_until.get(b, until))

    def _unpinned_first(self, n: int) -> dict[int, float]:
        """Put the n free blocks to take at the front of the free queue: unpinned ones in LRU order,
        then pinned ones, whose pins leave the pool: returns those {block: deadline} (the host KV
        tier may keep them pinned; the rest are reclaimed). Pins past their deadline are dropped first."""
        now, pins = time.monotonic(), self.pinned_until
        for b in [b for b, t in pins.items() if t <= now]:
            del pins[b]
        take = list(islice((b for b in self.free if b not in pins), n))  # stops at the n-th: the front's usual
        reclaimed = {}
        if len(take) < n:
            reclaimed = {b: pins.pop(b) for b in list(islice((b for b in self.free if b in pins), n - len(take)))}
            take += reclaimed
        for b in reversed(take):
            self.free.move_to_end(b, last=False)  # the blocks to take, at the front in their order
        return reclaimed

    def ref(self, blocks: list[int]) -> None:
        """Add one reference to each block (a prefix hit or a fork); revives free cached blocks."""
        rc, free = self.refcount, self.free
        for b in blocks:
            if rc[b] == 0:
                del free[b]
            rc[b] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference from each block. Blocks that reach 0 join the free queue: hashed ones at
        the back (kept longest, tail of a chain first to go), unhashed ones at the front."""
        rc, free = self.refcount, self.free
        for b in reversed(blocks):
            rc[b] -= 1
            if rc[b] < 0:
                raise RuntimeError(f"block {b} released more often than referenced")
            if rc[b] == 0:
                h = self.block_hash[b]
                free[b] = None
                if h is not None and self.cached.setdefault(h, b) == b:
                    self._link(b, h)
                    if self.host_kv is not None:  # (it may answer anew: a twin that answered was evicted)
                        self._supersede(b, h)
                    continue  # findable: kept at the back
                self.block_hash[b] = None  # unhashed, or a duplicate another block answers for
                if h is not None and b in self.pinned_until:  # a pinned twin: the answering block keeps the pin
                    self.pin([self.cached[h]], self.pinned_until.pop(b))
                free.move_to_end(b, last=False)

    def set_hash(self, block: int, h: bytes, parent: Optional[bytes] = None) -> None:
        """Record a full block's chained hash (and the hash of the block before it, b"" for the
        first); the first block with a hash answers lookups for it."""
        if parent is not None:
            self.parent[block] = parent
        elif self.block_hash[block] == h and self.cached.get(h) == block:
            return  # a checkpoint's re-registration: already the one answering, linked when it became so
        self.block_hash[block] = h
        if self.cached.setdefault(h, block) == block:
            self._link(block, h)
            if self.host_kv is not None:  # one tier at a time: the device's block supersedes a host copy
                self._supersede(block, h)

    def _supersede(self, block: int, h: bytes) -> None:
        """`block` answers for h again: the host KV tier drops its copy, whose pin (if any) it keeps."""
        until = self.host_kv.superseded(h)
        if until > time.monotonic():
            self.pin([block], until)

    def _link(self, block: int, h: bytes) -> None:
        if self.parent[block] is not None:
            self.children.setdefault(self.parent[block], set()).add(h)

    def has_other_child(self, parent: bytes, child: Optional[bytes]) -> bool:
        """Whether a cached block continues `parent` with content other than `child`: the
        prefix tree branches there."""
        kids = self.children.get(parent, ())
        return any(k != child for k in kids)

    def lookup(self, h: bytes) -> Optional[int]:
        return self.cached.get(h)

    def _drop_hash(self, b: int) -> None:
        h = self.block_hash[b]
        if h is not None:
            self.block_hash[b] = None
            if self.cached.get(h) == b:
                del self.cached[h]
                p = self.parent[b]
                if p is not None and p in self.children:
                    self.children[p].discard(h)
                    if not self.children[p]:
                        del self.children[p]
            self.parent[b] = None

    # ---- blocks loaded from a lower tier (memory/host_kv_tier.py, memory/disk_tier.py) ----------
    def has_room_for(self, hashes: Sequence[bytes], needed: range, n: int) -> bool:
        """Whether `n` loaded blocks fit beside the free cached blocks of the prefix `needed`
        (indices into hashes) that adopting them must keep."""
        kept = sum(1 for i in needed if hashes[i] in self.cached and self.refcount[self.cached[hashes[i]]] == 0)
        return self.num_free - kept >= n

    def adopt(self, hashes: Sequence[bytes], needed: range, blocks: Sequence[tuple], charge: Charge = None) -> None:
        """Make loaded blocks cached blocks: `blocks` = (index into hashes, {layer: one block's
        tensor}, parent hash) for the indices of the prefix `needed` that the pool lacks
        (has_room_for first). The prefix's own blocks are held meanwhile, so none is evicted for
        these, and all are released in chain order (the prefix's first block kept longest). The
        data is written layer by layer (`scatter`), `charge(seconds)` told the time it takes."""
        if not blocks:
            return
        held = {i: self.cached[hashes[i]] for i in needed if hashes[i] in self.cached}
        self.ref(list(held.values()))
        new = self.allocate(len(blocks))
        self.scatter(new, {layer: torch.stack([kv[layer] for _, kv, _ in blocks]) for layer in self.kv}, charge)
        for b, (i, _, parent) in zip(new, blocks):
            self.set_hash(b, hashes[i], parent)
            held[i] = b
        self.release([held[i] for i in needed])

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block `src` into `dst` in every layer (copy-on-write of a shared partial block)."""
        if self.loads.pending:
            self.loads.settle()
        for t in self.kv.values():
            t[dst].copy_(t[src])
        if self.mirror is not None:
            self.mirror.copied(src, dst)

    def gather(self, blocks: list[int], device: torch.device | str = "cpu", pin: bool = False) -> dict[int, torch.Tensor]:
        """Copy blocks out: `{layer: [len(blocks), 2, block_size, kv_heads, head_dim]}` on `device`."""
        if self.loads.pending:
            self.loads.settle()
        if self.mirror is not None:  # every rank's heads
            return self.mirror.gathered(blocks, self._copy_out(blocks, "cpu", False), device, pin)
        return self._copy_out(blocks, device, pin)

    def _copy_out(self, blocks: list[int], device: torch.device | str, pin: bool) -> dict[int, torch.Tensor]:
        idx = torch.tensor(blocks, dtype=torch.long, device=self._device)
        out = {}
        for i, t in self.kv.items():
            src = t.index_select(0, idx)
            dst = torch.empty(src.shape, dtype=src.dtype, device=device, pin_memory=pin)
            out[i] = dst.copy_(src)
        return out

    def scatter(self, blocks: list[int], data: Mapping[int, torch.Tensor], charge: Charge = None) -> None:
        """Write `data[layer] : [len(blocks), 2, block_size, kv_heads, head_dim]` (host tensors) into
        `blocks`, each layer's before that layer next runs (`loads`)."""
        if self.mirror is not None:  # data holds every rank's heads: this pool keeps its own
            data = self.mirror.scattered(blocks, data)
        self.loads.load({i: _blocks_write(t, blocks, data[i]) for i, t in self.kv.items()}, charge)

    @property
    def _device(self) -> torch.device:
        return next(iter(self.kv.values())).device if self.kv else torch.device("cpu")


def _blocks_write(pool: torch.Tensor, blocks: list[int], data: torch.Tensor):
    def write() -> None:  # (the index made on the stream that writes: the copy stream on CUDA)
        idx = torch.tensor(blocks, dtype=torch.long, device=pool.device)
        pool.index_copy_(0, idx, data.to(pool.device, pool.dtype, non_blocking=True))
    return write
