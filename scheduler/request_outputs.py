"""What a step hands back for one request: its `RequestOutput` (prompt, the n sequences so far).

Built only for requests a caller reads this step: every advanced one when the caller streams
(the server), only finished ones otherwise (`LLM.generate`, as vLLM's FINAL_ONLY output kind).
"""
from __future__ import annotations

from hybridkv.outputs import CompletionOutput, RequestOutput

from .request_group import RequestGroup


def request_output(g: RequestGroup, done: bool, tokenizer) -> RequestOutput:
    """g's output now; `done`: every sequence of it has finished. Token and logprob lists are
    copies (the sequences go on growing)."""
    outs = [CompletionOutput(s.seq_index, s.output_token_ids, s.finish_reason,
                             list(s.output_logprobs) if s.params.logprobs is not None else None,
                             tokenizer, tuple(s.params.stop), error=s.error, stop_reason=s.stop_reason)
            for s in g.seqs]
    first = g.seqs[0]
    prompt_done = done or first.num_output_tokens > 0
    prompt_logprobs = list(g.prompt_logprobs) if g.prompt_logprobs is not None and prompt_done else None
    return RequestOutput(g.request_id, g.prompt, g.prompt_token_ids, outs, done, first.num_cached_tokens,
                         prompt_logprobs)
