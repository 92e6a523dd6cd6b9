"""Which tokens' logits a step asks the model for: the last token of each chunk (to sample), plus
the prompt positions of requests that asked for `prompt_logprobs` (only those rows: a [T, V]
logits tensor for a whole prefill batch would cost T x V floats).

A chunk covering prompt positions [start, end) returns the logits of positions start .. min(end,
P - 1) - 1, each predicting the prompt token after it; position P - 1 predicts the first output
token and is the chunk's sampling row.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from hybridkv.outputs import PositionLogprobs

from .sampler import gather_logprobs


@dataclass
class PromptSpan:
    """Rows row0 .. row0+count-1 of the logits hold prompt positions pos0 .. pos0+count-1."""

    row0: int
    pos0: int
    count: int


@dataclass
class LogitRows:
    """indices: the batch's token indices whose logits come back (None: the last of each chunk,
    the model's default); last: per chunk, the logits row of its last token; spans: {chunk index:
    its prompt-logprob rows} for the chunks that have some (most steps: none); drafts: {chunk
    index: the row of its first token} for the chunks that verify a draft (a row per token, the
    last at `last`)."""

    indices: Optional[list[int]]
    last: list[int]
    spans: dict[int, PromptSpan]
    drafts: dict[int, int] = field(default_factory=dict)

    def finite(self, logits: torch.Tensor) -> list[bool]:
        """Per chunk: are all its rows finite (one host copy of [N] bools)."""
        if bool(torch.isfinite(logits.sum(dim=-1)).all()):  # a NaN or inf anywhere makes its row's sum one
            return [True] * len(self.last)
        rows = torch.isfinite(logits).all(dim=-1).tolist()
        if not self.spans and not self.drafts:
            return [rows[last] for last in self.last]
        return [all(rows[self.drafts.get(i, last):last + 1]) and (s is None or all(rows[s.row0:s.row0 + s.count]))
                for i, (last, s) in enumerate(zip(self.last, (self.spans.get(i) for i in range(len(self.last)))))]


def plan_logit_rows(chunks, wants_prompt_logprobs: Callable[[object], bool]) -> LogitRows:
    """chunks: the step's ScheduledChunks in batch order (seq, start, num_tokens);
    wants_prompt_logprobs(seq): whether that sequence's prompt logprobs are being collected
    (asked only of chunks that cover prompt positions before the last)."""
    asking = {i for i, c in enumerate(chunks)  # a plain decode (c.decode) is past its prompt
              if not c.decode and c.start < min(c.start + c.num_tokens, c.seq.num_prompt_tokens - 1)
              and wants_prompt_logprobs(c.seq)}
    drafting = any(c.draft for c in chunks)
    if not asking and not drafting:  # the model's default rows: the last token of each chunk
        return LogitRows(None, list(range(len(chunks))), {})
    indices, last, spans, drafts, offset = [], [], {}, {}, 0
    for i, c in enumerate(chunks):
        if c.draft:  # every position: each is sampled and compared with the draft
            drafts[i] = len(indices)
            indices.extend(range(offset, offset + c.num_tokens))
            offset += c.num_tokens
            last.append(len(indices) - 1)
            continue
        end = min(c.start + c.num_tokens, c.seq.num_prompt_tokens - 1)
        if i in asking:
            spans[i] = PromptSpan(len(indices), c.start, end - c.start)
            indices.extend(range(offset, offset + end - c.start))
        offset += c.num_tokens
        last.append(len(indices))
        indices.append(offset - 1)
    return LogitRows(indices, last, spans, drafts)


def prompt_logprobs(logits: torch.Tensor, token_ids: Sequence[int], span: PromptSpan, k: int
                    ) -> list[PositionLogprobs]:
    """The logprobs (chosen prompt token with its rank, plus the top k) of prompt tokens
    pos0+1 .. pos0+count, from logits [N, V] rows of `span`."""
    targets = torch.tensor(token_ids[span.pos0 + 1:span.pos0 + 1 + span.count], dtype=torch.long)
    return gather_logprobs(logits[span.row0:span.row0 + span.count], targets, [k] * span.count)
