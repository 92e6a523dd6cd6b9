"""A request group: one user request and its n sequences (hybridkv/request.py's `Request` each).

Index 0 is made with the request; its n - 1 siblings fork from it once its prompt is computed
(they share its blocks and start from a copy of its state). The group is the output side's
object: the prompt text, prompt logprobs, and whether anyone inside the engine owns its output.
"""
from __future__ import annotations

from typing import Optional

from hybridkv.request import Request, RequestStatus
from hybridkv.sampling_params import SamplingParams

from .sampler import SampleRow
from .stopping import decoded_logprobs


class RequestGroup:
    """One request: a prompt and its n sequences (index 0 first; forks join after prefill).

    request_id: the id its outputs carry. key: the engine's name for it, the user's id for a
    request added by id; a tuple for one the engine owns (`generate`'s), which no user id (a
    string) can equal. Sequences are named from the key.
    """

    def __init__(self, request_id: str, prompt: Optional[str], params: SamplingParams,
                 seqs: Optional[list[Request]] = None, key=None):
        self.request_id = request_id
        self.key = request_id if key is None else key
        self.for_generate = False     # added by LLM.generate, which takes its finished output
        self.background = False       # the engine's own work (hit_guard.py's shadows): no output
        self.failed = False           # ended with "error": its pending forks will never be made
        self.prompt = prompt          # the text, when the prompt came as text
        # with params.prompt_logprobs: per prompt position {token id: Logprob}, None for position 0
        self.prompt_logprobs: Optional[list] = None
        self.params = params
        self.seqs: list[Request] = seqs or []
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

    def fork_rows(self, seq: Request) -> list:
        """The sampler's rows of the forks made when `seq` finishes its prompt (none unless it is
        the first sequence and forks are pending): each fork's draw comes from seq's logits row."""
        if seq.seq_index != 0 or self.failed or not self.forks_pending:
            return []
        first = len(self.seqs)
        return [SampleRow(seq.params, j, 0, seq.token_ids, seq.num_prompt_tokens)
                for j in range(first, first + self.forks_pending)]

    def make_forks(self, parent: Request) -> list[Request]:
        """The pending siblings, made now from `parent` (the first sequence, its prompt just
        computed) and added to the group; none for another sequence. Fork j is named
        (key, j): a tuple, never equal to a user's id."""
        if parent.seq_index != 0:
            return []
        made = [parent.fork((self.key, j), j) for j in range(len(self.seqs), self.params.n)]
        self.seqs.extend(made)
        return made

    def collects_prompt_logprobs(self, seq: Request) -> bool:
        return self.prompt_logprobs is not None and seq.seq_index == 0

    def record_prompt_logprobs(self, pos0: int, entries: list, tokenizer) -> None:
        """Keep the prompt logprobs of positions pos0 + 1, pos0 + 2, ... (the runner's entries,
        decoded with `tokenizer`: {token id: Logprob} each)."""
        self.prompt_logprobs[pos0 + 1:pos0 + 1 + len(entries)] = [decoded_logprobs(tokenizer, e) for e in entries]

    @property
    def finished(self) -> bool:
        if not self.failed and self.forks_pending:
            return False
        for s in self.seqs:
            if s.status is not RequestStatus.FINISHED:
                return False
        return True
