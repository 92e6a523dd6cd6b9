"""`AsyncLLM`: the engine on one thread of its own (engine_loop.py), streaming delta outputs to
asyncio callers.

    engine = AsyncLLM(LLM(path, ...))
    async for d in engine.generate(prompt_token_ids, SamplingParams(...), "req-1"):
        d.index, d.token_ids, d.text, d.finish_reason      # only what is new since the last delta

Each request's news goes to a `QueueSink` on the caller's event loop, so the event loop never
waits on the model; its `RequestStream` detokenizes it. Closing a generator before its request
finished (a client that went away) aborts the request: its blocks and slot are freed at the
next turn of the engine loop.
"""
from __future__ import annotations

import asyncio
from typing import Callable, Optional

from hybridkv.sampling_params import SamplingParams

from .engine_loop import EngineLoop
from .news import DeltaOutput, EngineDeadError  # noqa: F401 - what its callers get and catch
from .request_stream import RequestStream, StreamingEngine
from .sink import QueueSink


class AsyncLLM(EngineLoop, StreamingEngine):
    """Owns `llm` on a background thread; `generate` streams deltas; `abort`, `stats`, `close`.

    Every `log_stats_interval` seconds in which the engine stepped, one stats line is logged
    (`StatsLogger`, logger `hybridkv.engine`); 0 turns it off.
    """

    def __init__(self, llm, log_stats_interval: float = 10.0):
        self.tokenizer = llm.get_tokenizer()
        super().__init__(llm, log_stats_interval)

    @classmethod
    def create(cls, model: str, log_stats_interval: float = 10.0, data_parallel_size: int = 1, **llm_kwargs):
        """Build the `LLM(model, **llm_kwargs)` (the same options) and own it; data_parallel_size
        != 1: a DataParallelLLM of that many engine processes (same interface, data_parallel.py)."""
        from hybridkv.llm import LLM

        if data_parallel_size != 1:
            from .data_parallel import DataParallelLLM

            return DataParallelLLM(model, data_parallel_size, log_stats_interval, **llm_kwargs)

        return cls(LLM(model, **llm_kwargs), log_stats_interval)

    async def call(self, fn: Callable):
        return await asyncio.wrap_future(self.submit(fn))

    async def stats(self) -> dict:
        """`LLM.stats()`, read on the engine thread."""
        return await self.call(lambda llm: llm.stats())

    async def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                          priority: int = 0, cache_salt: Optional[str] = None) -> RequestStream:
        """Queue a request; bad input raises ValueError (nothing queued). Iterate the returned
        stream for its deltas; `abort()` it (or leave its loop early) to stop it."""
        sink = QueueSink()
        await self.call(lambda llm: self.add(llm, request_id, prompt_token_ids, params, priority, cache_salt, sink))
        return RequestStream(self, request_id, params, sink)

