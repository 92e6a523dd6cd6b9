"""What a data-parallel replica process and its parent say to each other besides commands:
the facts a replica sends once, its answer to a probe, and a request in transit."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from .replica_group import SnapshotHeader


@dataclass
class ReplicaFacts:
    """What the serving layer reads of an LLM, sent once by a replica that started."""

    tokenizer: Any
    max_model_len: Optional[int]
    generation_defaults: Any
    max_num_seqs: int
    kv_blocks_total: int
    state_slots_total: int
    pid: int


@dataclass
class ReplicaProbe:
    """A replica's answer to "where would this prompt go": its usable cached prefix (hybrid hit
    rule) and its load, in tokens of running + waiting requests."""

    hit_tokens: int
    load_tokens: int
    running: int
    waiting: int
    max_num_seqs: int


@dataclass
class MovedRequest:
    """A request in transit between replicas: its snapshot (bytes from snapshot_io, or the header
    of tensors sent over the gloo group) and how many tokens per sequence its client has been
    sent, so the new replica posts only new ones."""

    request_id: str
    snapshot: Union[bytes, SnapshotHeader]
    sent: dict[int, int]
    prompt_logged: bool
