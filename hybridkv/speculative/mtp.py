"""MTP drafting: the target checkpoint's own multi-token-prediction head proposes the next token
(models/mtp_head.py). The head runs inside the target's step, after sampling, over every
position the step computed (its KV is kept in the target's pools), so a proposal costs no extra
step: the model runner returns, for each sequence that sampled, the token its head proposes two
positions on (`RunnerOutput.drafts`); the scheduler records them here and the next step verifies
them. One token a step: the checkpoint's one MTP layer is not chained in this version."""
from __future__ import annotations

from typing import Hashable, Mapping, Sequence


class MtpDrafter:
    """Proposals computed by the model runner, kept until the step that can verify them."""

    def __init__(self):
        self._next: dict[Hashable, tuple[int, int]] = {}  # request id -> (index of the drafted token, token)

    def record(self, drafts: Mapping[Hashable, tuple[int, int]]) -> None:
        """The runner's proposals of a step: {request id: (the index the token would take, token)}."""
        self._next.update(drafts)

    def propose(self, request_id: Hashable, tokens: Sequence[int], k: int) -> list[int]:
        """The recorded proposal when it is for the token after `tokens` (else none)."""
        d = self._next.get(request_id)
        return [d[1]] if d is not None and k >= 1 and d[0] == len(tokens) else []

    def propose_many(self, asks) -> list[list[int]]:
        """asks: (request id, its tokens, k) -> a proposal for each."""
        return [self.propose(rid, tokens, k) for rid, tokens, k in asks]

    def forget(self, request_id: Hashable) -> None:
        self._next.pop(request_id, None)
