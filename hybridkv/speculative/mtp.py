"""MTP drafting: the target checkpoint's own multi-token-prediction head proposes the next token
(models/mtp_head.py). The head runs inside the target's step, after sampling, over every
position the step computed (its KV is kept in the target's pools), so a proposal costs no extra
step: the model runner returns, for each sequence that sampled, the token its head proposes two
positions on, then the head chained to k tokens (`RunnerOutput.drafts`; models/mtp_head.py: a
chain stops at its block's end); the scheduler records them here and the next step verifies them."""
from __future__ import annotations

from typing import Hashable, Mapping, Sequence


class MtpDrafter:
    """Proposals computed by the model runner, kept until the step that can verify them."""

    def __init__(self):
        self._next: dict[Hashable, tuple[int, list[int]]] = {}  # request id -> (index of its first token, tokens)

    def record(self, drafts: Mapping[Hashable, tuple[int, list[int]]]) -> None:
        """The runner's proposals of a step: {request id: (the index the first token would take, tokens)}."""
        self._next.update(drafts)

    def propose(self, request_id: Hashable, tokens: Sequence[int], k: int) -> list[int]:
        """The recorded proposal's first k tokens when it is for the tokens after `tokens` (else none)."""
        d = self._next.get(request_id)
        return list(d[1][:k]) if d is not None and d[0] == len(tokens) else []

    def propose_many(self, asks) -> list[list[int]]:
        """asks: (request id, its tokens, k) -> a proposal for each."""
        return [self.propose(rid, tokens, k) for rid, tokens, k in asks]

    def forget(self, request_id: Hashable) -> None:
        self._next.pop(request_id, None)
