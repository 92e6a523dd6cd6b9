"""`RequestStream`: the caller's side of one request, its news read from a `QueueSink` and
detokenized into `DeltaOutput`s.

    stream = await engine.add_request(ids, params, "req-1")   # AsyncLLM or DataParallelLLM
    async for d in stream: ...                                  # leaving early aborts it

The engine it came from needs `tokenizer` and `abort(request_id)`.
"""
from __future__ import annotations

from typing import AsyncIterator, Optional

from hybridkv.sampling_params import SamplingParams

from .detokenizer import IncrementalDetokenizer, StopHoldback
from .news import DeltaOutput, StepNews, TokenDelta
from .sink import QueueSink


class RequestStream:
    """The deltas of one request, in order; `finished` once all its sequences are done."""

    def __init__(self, engine, request_id: str, params: SamplingParams, sink: QueueSink):
        self.engine, self.request_id, self.params, self._sink = engine, request_id, params, sink
        self.finished = False
        self._done: set[int] = set()  # sequence indices whose finish was read
        self._prompt = (0, 0)  # the last news' prompt and cached tokens

    def abort(self) -> None:
        """Stop the request if it is still running (idempotent, does not wait)."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)

    def end(self, reason: str) -> None:
        """Finish each unfinished sequence with `reason` (a server stopping: "abort") and stop the
        request; the reader gets those finishes as its last deltas. Call on the sink's event loop."""
        if self.finished:
            return
        self.engine.abort(self.request_id)
        n = self.params.n
        self._sink.queue.put_nowait(StepNews([TokenDelta(i, [], None, reason, None) for i in range(n)
                                              if i not in self._done], *self._prompt, True))

    async def __aiter__(self) -> AsyncIterator[DeltaOutput]:
        detok: dict[int, IncrementalDetokenizer] = {}
        hold: dict[int, StopHoldback] = {}
        try:
            while not self.finished:
                news = await self._sink.queue.get()
                if isinstance(news, BaseException):
                    self.finished = True
                    raise news
                if news.deltas:
                    self._prompt = (news.num_prompt_tokens, news.num_cached_tokens)
                for j, d in enumerate(news.deltas):
                    if d.index in self._done:  # finished already (an end() raced the engine's finish)
                        continue
                    if d.finish_reason is not None:
                        self._done.add(d.index)
                    if d.index not in detok:
                        detok[d.index] = IncrementalDetokenizer(self.engine.tokenizer)
                        hold[d.index] = StopHoldback(self.params.stop)
                    new = detok[d.index].push(d.token_ids)
                    text = (hold[d.index].push(new) if d.finish_reason is None
                            else hold[d.index].finish(new, d.final_text))
                    yield DeltaOutput(self.request_id, d.index, d.token_ids, text, d.logprobs,
                                      d.finish_reason, news.num_prompt_tokens, news.num_cached_tokens,
                                      d.stop_reason, news.prompt_logprobs if j == 0 else None)
                self.finished = self.finished or news.finished
        finally:
            self.abort()


class StreamingEngine:
    """What AsyncLLM and DataParallelLLM share: `generate` over the stream of their `add_request`."""

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       priority: int = 0, cache_salt: Optional[str] = None) -> AsyncIterator[DeltaOutput]:
        """Yield the request's deltas until all its sequences finish; leaving early aborts it."""
        stream = await self.add_request(prompt_token_ids, params, request_id, priority, cache_salt)
        try:
            async for d in stream:
                yield d
        finally:
            stream.abort()
