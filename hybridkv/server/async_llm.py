"""`AsyncLLM`: the engine on one thread of its own, streaming delta outputs to asyncio callers.

    engine = AsyncLLM(LLM(path, ...))
    async for d in engine.generate(prompt_token_ids, SamplingParams(...), "req-1"):
        d.index, d.token_ids, d.text, d.finish_reason      # only what is new since the last delta

The engine thread is the only caller of the `LLM`: adds, aborts and stats reach it as commands
through a thread-safe queue, run between two steps. It steps while any request is unfinished
and posts each request's new tokens to that request's asyncio queue, so the event loop never
waits on the model. Closing a generator before its request finished (a client that went away)
aborts the request: its blocks and slot are freed at the next turn of the engine loop.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional

from hybridkv.sampling_params import SamplingParams

from .detokenizer import IncrementalDetokenizer, StopHoldback
from .stats_log import StatsLogger

log = logging.getLogger("hybridkv.engine")


@dataclass
class TokenDelta:
    """New tokens of sequence `index` from one step (engine thread -> event loop)."""

    index: int
    token_ids: list[int]
    logprobs: Optional[list[dict[int, float]]]
    finish_reason: Optional[str]
    final_text: Optional[str]  # the engine's whole text (stop string cut) once finished
    stop_reason: Optional[int | str] = None  # the stop string or id that ended it


@dataclass
class StepNews:
    """What one step did for one request."""

    deltas: list[TokenDelta]
    num_prompt_tokens: int
    num_cached_tokens: int
    finished: bool
    prompt_logprobs: Optional[list] = None  # once, when the prompt is computed (if asked)


@dataclass
class DeltaOutput:
    """What `AsyncLLM.generate` yields: the new part of sequence `index` of a request."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: Optional[list[dict[int, float]]]
    finish_reason: Optional[str]
    num_prompt_tokens: int
    num_cached_tokens: int
    stop_reason: Optional[int | str] = None
    prompt_logprobs: Optional[list] = None  # on the request's first delta, when asked


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    sent: dict[int, int] = field(default_factory=dict)  # sequence index -> tokens already posted
    done: set[int] = field(default_factory=set)  # sequence indices whose finish was posted
    prompt_logged: bool = False  # its computed prompt tokens went to the stats line


class EngineDeadError(RuntimeError):
    """The engine thread stopped (an error in a step, or close()): no request can run."""


class AsyncLLM:
    """Owns `llm` on a background thread; `generate` streams deltas; `abort`, `stats`, `close`.

    Every `log_stats_interval` seconds in which the engine stepped, one stats line is logged
    (`StatsLogger`, logger `hybridkv.engine`); 0 turns it off.
    """

    def __init__(self, llm, log_stats_interval: float = 10.0):
        self.llm = llm
        self.tokenizer = llm.get_tokenizer()
        self.log_stats_interval = log_stats_interval
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self.dead: Optional[BaseException] = None
        self._dead_lock = threading.Lock()  # no command slips in after the engine stopped
        self._stats_log = StatsLogger(log_stats_interval)
        self._thread = threading.Thread(target=self._run, name="hybridkv-engine", daemon=True)
        self._thread.start()

    @classmethod
    def create(cls, model: str, log_stats_interval: float = 10.0, data_parallel_size: int = 1, **llm_kwargs):
        """Build the `LLM(model, **llm_kwargs)` (the same options) and own it; data_parallel_size
        != 1: a DataParallelLLM of that many engine processes (same interface, server/replicas.py)."""
        from hybridkv.llm import LLM

        if data_parallel_size != 1:
            from .replicas import DataParallelLLM

            return DataParallelLLM(model, data_parallel_size, log_stats_interval, **llm_kwargs)

        return cls(LLM(model, **llm_kwargs), log_stats_interval)

    # ---- the caller's side (any thread; generate on an event loop) ---------------------------
    def submit(self, fn: Callable) -> concurrent.futures.Future:
        """Run `fn(llm)` on the engine thread between two steps; a Future of its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._dead_lock:
            if self.dead is None:
                self._cmds.put((fut, fn))
                return fut
        fut.set_exception(EngineDeadError(f"the engine is not running: {self.dead}"))
        return fut

    async def call(self, fn: Callable):
        return await asyncio.wrap_future(self.submit(fn))

    async def stats(self) -> dict:
        """`LLM.stats()`, read on the engine thread."""
        return await self.call(lambda llm: llm.stats())

    def abort(self, request_id: str) -> None:
        """Stop a request and free its memory at the engine's next turn (does not wait)."""
        self.submit(lambda llm: self._abort(llm, request_id))

    async def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                          priority: int = 0, cache_salt: Optional[str] = None) -> "RequestStream":
        """Queue a request; bad input raises ValueError (nothing queued). Iterate the returned
        stream for its deltas; `abort()` it (or leave its loop early) to stop it."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        await self.call(lambda llm: self._add(llm, request_id, prompt_token_ids, params, priority,
                                              cache_salt, stream))
        return RequestStream(self, request_id, params, stream)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       priority: int = 0, cache_salt: Optional[str] = None) -> AsyncIterator[DeltaOutput]:
        """Yield the request's deltas until all its sequences finish; leaving early aborts it."""
        stream = await self.add_request(prompt_token_ids, params, request_id, priority, cache_salt)
        try:
            async for d in stream:
                yield d
        finally:
            stream.abort()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (requests still running are aborted)."""
        if self._thread.is_alive():
            self._cmds.put((None, None))
            self._thread.join(timeout)

    # ---- the engine thread -------------------------------------------------------------------
    def _add(self, llm, rid, ids, params, priority, cache_salt, stream: _Stream) -> None:
        llm.add_request(ids, params, request_id=rid, priority=priority, cache_salt=cache_salt)
        self._streams[rid] = stream

    def _abort(self, llm, rid: str) -> None:
        stream = self._streams.pop(rid, None)
        if stream is not None:
            llm.abort(rid)
            _post_to(stream.loop, [(stream.queue, StepNews([], 0, 0, True))])  # ends its iterator

    def _run(self) -> None:
        idle_wait = min(1.0, self.log_stats_interval or 1.0)  # so the line after a burst is on time
        while True:
            busy = self.llm.has_unfinished_requests()
            cmds = []
            if not busy:
                try:
                    cmds.append(self._cmds.get(timeout=idle_wait))
                except queue.Empty:
                    pass
            while True:
                try:
                    cmds.append(self._cmds.get_nowait())
                except queue.Empty:
                    break
            for fut, fn in cmds:
                if fut is None:
                    return self._shutdown(EngineDeadError("the engine was closed"))
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(self.llm))
                    except BaseException as e:  # bad input: the caller's error, not the engine's
                        fut.set_exception(e)
            if self.llm.has_unfinished_requests():
                try:
                    self._post(self.llm.step())
                except Exception as e:
                    log.exception("engine step failed; the engine stops")
                    return self._shutdown(e)
            self._stats_log.maybe_log(self.llm.stats)

    def _post(self, outs) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            deltas, prompt_lps = [], None
            if not stream.prompt_logged and any(o.token_ids for o in out.outputs):  # prompt computed
                stream.prompt_logged = True
                prompt_lps = out.prompt_logprobs
                self._stats_log.on_prompt(len(out.prompt_token_ids) - out.num_cached_tokens)
            for o in out.outputs:
                sent = stream.sent.get(o.index, 0)
                done = o.finish_reason is not None
                if len(o.token_ids) == sent and (not done or o.index in stream.done):
                    continue
                if done:
                    stream.done.add(o.index)
                new_lp = o.logprobs[sent:] if o.logprobs is not None else None
                deltas.append(TokenDelta(o.index, list(o.token_ids[sent:]), new_lp, o.finish_reason,
                                         o.text if o.finish_reason is not None else None, o.stop_reason))
                stream.sent[o.index] = len(o.token_ids)
            if out.finished:
                del self._streams[out.request_id]
            if deltas or out.finished:
                news = StepNews(deltas, len(out.prompt_token_ids), out.num_cached_tokens, out.finished,
                                prompt_lps)
                by_loop.setdefault(stream.loop, []).append((stream.queue, news, out.request_id))
        for loop, items in by_loop.items():
            if not _post_to(loop, [(q, news) for q, news, _ in items]):
                for _, _, rid in items:  # its caller's event loop is gone: nobody will read these
                    self._abort(self.llm, rid)

    def _shutdown(self, err: BaseException) -> None:
        with self._dead_lock:
            self.dead = err
        for rid, stream in list(self._streams.items()):
            try:
                self.llm.abort(rid)
            except Exception:  # the engine may be broken; the callers still hear why
                pass
            _post_to(stream.loop, [(stream.queue, EngineDeadError(str(err)))])
        self._streams.clear()
        while True:  # commands that arrived too late
            try:
                fut, _ = self._cmds.get_nowait()
            except queue.Empty:
                return
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_exception(EngineDeadError(f"the engine is not running: {err}"))


class RequestStream:
    """The deltas of one request, in order; `finished` once all its sequences are done."""

    def __init__(self, engine: AsyncLLM, request_id: str, params: SamplingParams, stream: _Stream):
        self.engine, self.request_id, self.params, self._stream = engine, request_id, params, stream
        self.finished = False

    def abort(self) -> None:
        """Stop the request if it is still running (idempotent, does not wait)."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)

    async def __aiter__(self) -> AsyncIterator[DeltaOutput]:
        detok: dict[int, IncrementalDetokenizer] = {}
        hold: dict[int, StopHoldback] = {}
        try:
            while not self.finished:
                news = await self._stream.queue.get()
                if isinstance(news, BaseException):
                    self.finished = True
                    raise news
                for j, d in enumerate(news.deltas):
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


def _deliver(items) -> None:
    for q, news in items:
        q.put_nowait(news)


def _post_to(loop: asyncio.AbstractEventLoop, items) -> bool:
    """Hand (queue, news) pairs to `loop`'s thread; False when that loop is closed."""
    try:
        loop.call_soon_threadsafe(_deliver, items)
        return True
    except RuntimeError:
        return False
