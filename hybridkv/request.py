"""A request: one sequence of tokens and everything the engine knows about its progress.

One object for the scheduler, the memory manager and the output side (vLLM's `Request`,
nano-vllm's `Sequence`): it holds ONE token list (prompt then output), its sampling params and
queue order, its status, and its memory progress — `num_computed_tokens`, the chained hashes of
its full blocks, and the checkpoint hints the manager sets (branch point, shared boundaries,
where its current run resumed). The memory manager keeps its blocks and slots per kind by
`request_id` and changes the progress fields only through its verbs; no one keeps a copy of the
tokens. A user request with n > 1 sequences is n of these in one `RequestGroup`
(scheduler/request_group.py), the forks made after the prompt.
"""
from __future__ import annotations

import enum
import itertools
import operator
import time
from typing import Any, Hashable, Optional

from hybridkv.sampling_params import SamplingParams

_serials = itertools.count()

# Who runs first: lower priority value, then earlier arrival, then earlier creation.
run_order = operator.attrgetter("priority", "arrival", "serial")


class RequestStatus(enum.Enum):
    WAITING = "waiting"      # holds no memory: new, or preempted by recompute (resumes through a prefix match)
    RUNNING = "running"      # holds its memory in every kind
    SWAPPED = "swapped"      # preempted by swap: a host copy of its memory waits in `swapped`
    FINISHED = "finished"


class Request:
    """One sequence of tokens. Read freely; the manager's fields change only through its verbs.

    request_id: the id the scheduler and the manager know it by: the group's key for index 0,
        `(group key, j)` for fork j (a tuple: no user id, always a string, can take it).
    token_ids: prompt + output tokens (a private copy of the list given).
    params: its SamplingParams (the defaults when none are given).
    max_tokens: output tokens it may generate (params.max_tokens, capped by the engine at what
        max_model_len leaves; 0 when neither it nor params is given); the same number is checked
        when it is added and at admission.
    priority: lower runs first, as in vLLM; arrival then serial break ties (earlier first).
    cache_salt, adapter_id, mm_hashes: what besides the tokens keys its blocks (block_hash.py).
    Set by the scheduler and the output side: status, finish_reason, error (why it finished with
        "error"), num_cached_tokens (prefix-hit tokens at first admission), output_logprobs
        ({token id: Logprob} per output token, when asked), stop_reason (the stop string or id
        that ended it; None for EOS and length), stop_rule (stopping.py, made at its first token).
    Set by the memory manager: extra_key (the hash key of its blocks besides the tokens),
        num_computed_tokens, block_hashes (chained hashes of the full blocks computed or
        matched), num_hashed_blocks, branch_point (where the policy 'branch_points' wants a
        checkpoint), shared (block boundaries where waiting requests of a burst need its state),
        resumed_from (where its current run started computing: the prefix hit, or where a
        swap-in or an import resumed it), swapped ({kind name: host copy} while SWAPPED).
    """

    __slots__ = ("request_id", "group_id", "seq_index", "token_ids", "num_prompt_tokens", "params",
                 "max_tokens", "priority", "cache_salt", "adapter_id", "mm_hashes", "arrival", "serial",
                 "status", "finish_reason", "error", "num_cached_tokens", "output_logprobs", "stop_reason",
                 "stop_rule", "extra_key", "num_computed_tokens", "block_hashes", "num_hashed_blocks",
                 "branch_point", "shared", "resumed_from", "swapped")

    def __init__(self, request_id: Hashable, token_ids, params: Optional[SamplingParams] = None, *,
                 max_tokens: Optional[int] = None, priority: int = 0, cache_salt: Optional[str] = None,
                 adapter_id: Any = None, mm_hashes: tuple = (), arrival: Optional[float] = None,
                 num_prompt_tokens: Optional[int] = None, group_id: Optional[Hashable] = None,
                 seq_index: int = 0):
        if params is None:  # a request of the memory manager alone: no output reserved unless asked
            params, max_tokens = SamplingParams(), max_tokens or 0
        self.request_id = request_id
        self.group_id = request_id if group_id is None else group_id
        self.seq_index = seq_index
        self.token_ids: list[int] = list(token_ids)
        self.num_prompt_tokens = len(self.token_ids) if num_prompt_tokens is None else num_prompt_tokens
        self.params = params
        self.max_tokens = params.max_tokens if max_tokens is None else max_tokens
        self.priority = priority
        self.cache_salt = cache_salt
        self.adapter_id = adapter_id
        self.mm_hashes = tuple(mm_hashes)
        self.arrival = time.monotonic() if arrival is None else arrival
        self.serial = next(_serials)
        self.status = RequestStatus.WAITING
        self.finish_reason: Optional[str] = None
        self.error: Optional[str] = None
        self.num_cached_tokens = 0
        self.output_logprobs: list[dict] = []
        self.stop_reason = None
        self.stop_rule = None
        self.extra_key = b""
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []
        self.num_hashed_blocks = 0
        self.branch_point: Optional[int] = None
        self.shared: list[int] = []
        self.resumed_from = 0
        self.swapped: Optional[dict] = None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.num_prompt_tokens} prompt + {self.num_output_tokens} "
                f"output tokens, {self.num_computed_tokens} computed, {self.status.value})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    num_generated = num_output_tokens  # the sampler reads a Request as a SampleRow (sampler.py)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token: int, logprobs: Optional[dict] = None) -> None:
        """Add a sampled token (computed by a later step)."""
        self.token_ids.append(token)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    def fork(self, request_id: Hashable, seq_index: int = 0) -> "Request":
        """A sibling that starts from this request's tokens now (its own list), in the same group;
        the manager's `fork` gives it a share of this one's memory."""
        return Request(request_id, self.token_ids, self.params, group_id=self.group_id, seq_index=seq_index,
                       priority=self.priority, cache_salt=self.cache_salt, adapter_id=self.adapter_id,
                       mm_hashes=self.mm_hashes, num_prompt_tokens=self.num_prompt_tokens,
                       max_tokens=self.max_tokens)
