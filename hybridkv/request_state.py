"""What the manager keeps per request between steps."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Optional

RUNNING = "running"          # holds blocks and a live slot
PREEMPTED = "preempted"      # recompute: holds nothing, resumes through a prefix match
SWAPPED = "swapped"          # holds a host copy of its blocks and slot


@dataclass(eq=False)
class RequestState:
    """One request as the manager sees it. Read freely; change only through the manager.

    token_ids: prompt + generated tokens known so far (the scheduler appends sampled tokens).
    block_ids: KV blocks covering [0, num_computed_tokens) and any tokens allocated past it.
    block_hashes: chained hashes of the full blocks of token_ids computed so far (or matched).
    slot: the live state slot (0, the null slot, for pure-attention models or when not running).
    branch_point: where the policy 'branch_points' wants a checkpoint (set at admission), or None.
    """

    req_id: Hashable
    token_ids: list[int]
    num_prompt_tokens: int
    max_tokens: int
    extra_key: bytes
    cache_salt: Optional[str] = None
    adapter_id: Any = None
    mm_hashes: tuple = ()
    status: str = PREEMPTED
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_hashed_blocks: int = 0
    slot: int = 0
    row: int = -1
    branch_point: Optional[int] = None
    rolling_checkpoint: Optional[bytes] = None  # hash of its latest checkpoint inside its output
    swapped: Any = None  # swap.HostCopy while SWAPPED
