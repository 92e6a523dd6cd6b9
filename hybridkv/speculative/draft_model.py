"""Draft-model drafting: a smaller checkpoint with the target's vocabulary proposes k greedy tokens,
run by an engine of its own — its own KV blocks, state slots and prefix cache, sized from its own
budget — so the target's pools and scheduler are untouched.

Each proposal asks that engine for k greedy tokens after the request's tokens; its prefix cache
(checkpoint policy 'prompt_end': the state at the last block boundary of every prompt it saw, and
the rolling one inside its output) resumes each request where it has computed it before, so a
proposal recomputes at most about a block of new tokens before its k decodes. All the requests
drafting in a step go as one batch (`propose_many`)."""
from __future__ import annotations

from typing import Hashable, Sequence

from hybridkv.sampling_params import SamplingParams

DRAFT_CHECKPOINT_POLICY = "prompt_end"  # the draft engine's: see the module doc
DRAFT_BUDGET_SHARE = 8  # the draft engine's pools take 1/8 of the memory budget, the target's the rest


class DraftModelDrafter:
    """`llm`: the draft's engine (an LLM of the draft checkpoint with checkpoint policy
    DRAFT_CHECKPOINT_POLICY; LLM builds it); `vocab_size`: the target's (the draft's must equal it)."""

    def __init__(self, llm, vocab_size: int):
        if llm.model.vocab_size != vocab_size:
            raise ValueError(f"draft model {llm.model_path!r} has a vocabulary of {llm.model.vocab_size} tokens; "
                             f"the target's has {vocab_size}: a draft must share the target's tokenizer")
        self.llm = llm
        self._params: dict[int, SamplingParams] = {}

    def _greedy(self, k: int) -> SamplingParams:
        p = self._params.get(k)
        if p is None:
            p = self._params[k] = SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)
        return p

    def propose_many(self, asks: Sequence[tuple[Hashable, Sequence[int], int]]) -> list[list[int]]:
        """asks: (request id, its tokens, k) -> k greedy draft tokens for each, in one batch."""
        if not asks:
            return []
        outs = self.llm.generate([list(tokens) for _, tokens, _ in asks], [self._greedy(k) for _, _, k in asks],
                                 use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def propose(self, request_id: Hashable, tokens: Sequence[int], k: int) -> list[int]:
        return self.propose_many([(request_id, tokens, k)])[0]

    def forget(self, request_id: Hashable) -> None:
        """Nothing per request: what the draft engine computed stays in its prefix cache."""
