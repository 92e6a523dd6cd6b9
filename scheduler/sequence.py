"""A sequence owns its tokens and progress; a group is one user request and its n sequences.

A `Sequence` holds ONE list, `token_ids` (prompt then output), and `num_prompt_tokens`. The memory
manager keeps a reference to that same list (passed to `admit` / `fork` / `import_snapshot`) and
its block and slot bookkeeping by `request_id`; nothing else keeps a copy of the tokens.
"""
from __future__ import annotations

import enum
import itertools
import operator
import time
from typing import Optional

from hybridkv.sampling_params import SamplingParams

from .sampler import SampleRow

_serials = itertools.count()

# Who runs first: lower priority value, then earlier arrival, then earlier creation.
run_order = operator.attrgetter("priority", "arrival", "serial")


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # not admitted yet, or preempted by recompute
    RUNNING = "running"      # holds blocks and a live slot
    SWAPPED = "swapped"      # preempted by swap: its KV and state wait in host memory
    FINISHED = "finished"


class Sequence:
    """One sequence: its tokens, sampling params, queue order and status.

    request_id: the id the scheduler and the manager know it by: the group's key for index 0,
        `(group key, j)` for fork j (a tuple: no user id, always a string, can take it).
    token_ids: prompt + output tokens (a private copy of the prompt given).
    priority: lower runs first, as in vLLM; arrival then serial break ties (earlier first).
    max_tokens: output tokens it may generate (params.max_tokens, capped by the engine at what
        max_model_len leaves); the same number is checked at the door and at admission.
    error: why it finished with finish_reason "error" (None otherwise).
    """

    def __init__(self, request_id: str, token_ids: list[int], params: SamplingParams, *,
                 group_id: Optional[str] = None, seq_index: int = 0, priority: int = 0,
                 cache_salt: Optional[str] = None, arrival: Optional[float] = None,
                 num_prompt_tokens: Optional[int] = None, max_tokens: Optional[int] = None):
        self.request_id = request_id
        self.group_id = request_id if group_id is None else group_id
        self.seq_index = seq_index
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(self.token_ids) if num_prompt_tokens is None else num_prompt_tokens
        self.params = params
        self.max_tokens = params.max_tokens if max_tokens is None else max_tokens
        self.priority = priority
        self.cache_salt = cache_salt
        self.arrival = time.monotonic() if arrival is None else arrival
        self.serial = next(_serials)
        self.status = SequenceStatus.WAITING
        self.finish_reason: Optional[str] = None
        self.error: Optional[str] = None
        self.num_cached_tokens = 0   # prefix-hit tokens at first admission
        self.output_logprobs: list[dict] = []  # {token id: Logprob} per output token, when asked
        self.stop_reason = None      # the stop string or stop id that ended it (None: EOS, length)
        self.stop_rule = None        # its StopRule (stopping.py), made by the engine at its first token

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.num_prompt_tokens} prompt + "
                f"{self.num_output_tokens} output tokens, {self.status.value})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    num_generated = num_output_tokens  # the sampler reads a Sequence as a SampleRow (sampler.py)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token: int, logprobs: Optional[dict] = None) -> None:
        """Add a sampled token (the manager sees it through the shared list)."""
        self.token_ids.append(token)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    def fork(self, request_id, seq_index: int) -> "Sequence":
        """A sibling that starts from this sequence's tokens now (its own list), in the same group."""
        return Sequence(request_id, self.token_ids, self.params, group_id=self.group_id,
                        seq_index=seq_index, priority=self.priority, cache_salt=self.cache_salt,
                        num_prompt_tokens=self.num_prompt_tokens, max_tokens=self.max_tokens)


class SequenceGroup:
    """One request: a prompt and its n sequences (index 0 first; forks join after prefill).

    request_id: the id its outputs carry. key: the engine's name for it, the user's id for a
    request added by id; a tuple for one the engine owns (`generate`'s), which no user id (a
    string) can equal. Sequences are named from the key.
    """

    def __init__(self, request_id: str, prompt: Optional[str], params: SamplingParams,
                 seqs: Optional[list[Sequence]] = None, key=None):
        self.request_id = request_id
        self.key = request_id if key is None else key
        self.owned = False            # an owner inside the engine (generate) takes its output
        self.failed = False           # ended with "error": its pending forks will never be made
        self.prompt = prompt          # the text, when the prompt came as text
        # with params.prompt_logprobs: per prompt position {token id: Logprob}, None for position 0
        self.prompt_logprobs: Optional[list] = None
        self.params = params
        self.seqs: list[Sequence] = seqs or []
        self._prompt_token_ids: Optional[list[int]] = None

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt, copied once (every step's output of this request carries the same list)."""
        if self._prompt_token_ids is None:
            self._prompt_token_ids = self.seqs[0].prompt_token_ids
        return self._prompt_token_ids

    @property
    def forks_pending(self) -> int:
        """How many of the n sequences do not exist yet (made when the first one's prompt is done)."""
        return self.params.n - len(self.seqs)

    def fork_rows(self, seq: Sequence) -> list:
        """The sampler's rows of the forks made when `seq` finishes its prompt (none unless it is
        the first sequence and forks are pending): each fork's draw comes from seq's logits row."""
        if seq.seq_index != 0 or self.failed or not self.forks_pending:
            return []
        first = len(self.seqs)
        return [SampleRow(seq.params, j, 0, seq.token_ids, seq.num_prompt_tokens)
                for j in range(first, first + self.forks_pending)]

    def collects_prompt_logprobs(self, seq: Sequence) -> bool:
        return self.prompt_logprobs is not None and seq.seq_index == 0

    def record_prompt_logprobs(self, pos0: int, entries: list) -> None:
        """Keep the prompt logprobs of positions pos0 + 1, pos0 + 2, ... ({token id: Logprob} each)."""
        self.prompt_logprobs[pos0 + 1:pos0 + 1 + len(entries)] = entries

    @property
    def finished(self) -> bool:
        if not self.failed and self.forks_pending:
            return False
        for s in self.seqs:
            if s.status is not SequenceStatus.FINISHED:
                return False
        return True
