"""What the manager keeps per request between steps (the kinds keep their memory by request id)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Optional

RUNNING = "running"          # holds its memory in every kind
PREEMPTED = "preempted"      # recompute: holds nothing, resumes through a prefix match
SWAPPED = "swapped"          # holds a host copy of its memory


@dataclass(eq=False, slots=True)
class RequestState:
    """One request as the manager sees it. Read freely; change only through the manager.

    token_ids: the owner's list of prompt + generated tokens (the manager never copies it).
    block_hashes: chained hashes of the full blocks of token_ids computed so far (or matched).
    branch_point: where the policy 'branch_points' wants a checkpoint (set at admission), or None.
    shared: block boundaries where waiting requests of a burst need this request's state.
    resumed_from: where its current run started computing (the prefix hit, or where a swap-in
        or an import resumed it); the policy values a prompt-end state by what it adds past it.
    swapped: {kind name: host copy} while SWAPPED.
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
    block_hashes: list[bytes] = field(default_factory=list)
    num_hashed_blocks: int = 0
    branch_point: Optional[int] = None
    shared: list[int] = field(default_factory=list)
    resumed_from: int = 0
    swapped: Optional[dict] = None
