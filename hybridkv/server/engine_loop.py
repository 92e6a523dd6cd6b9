"""`EngineLoop`: an `LLM` on one engine thread of its own, posting each request's news to its sink.

    engine = EngineLoop(llm)
    engine.submit(lambda llm: engine.add(llm, "req-1", ids, params, 0, None, sink))   # a Future
    engine.abort("req-1");  engine.close()

The engine thread is the only caller of the `LLM`: adds, aborts and stats reach it as commands
through a thread-safe queue, run between two steps. It steps while any request is unfinished
and posts each request's new tokens as `StepNews` to that request's `NewsSink` (sink.py), so
whoever reads them never waits on the model. `AsyncLLM` puts asyncio queues behind the sinks, a
data-parallel replica its pipe (engine_process.py); the loop is the same.
"""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

from .news import EngineDeadError, StepNews, TokenDelta
from .sink import NewsSink
from .stats_log import StatsLogger

log = logging.getLogger("hybridkv.engine")


@dataclass
class RequestFeed:
    """Where one request's news goes and how much of it went (engine thread)."""

    sink: NewsSink
    sent: dict[int, int] = field(default_factory=dict)  # sequence index -> tokens already posted
    done: set[int] = field(default_factory=set)  # sequence indices whose finish was posted
    prompt_logged: bool = False  # its computed prompt tokens went to the stats line


class EngineLoop:
    """Owns `llm` on a background thread; `submit` runs a function on it, `abort`, `close`.

    Every `log_stats_interval` seconds in which the engine stepped, one stats line is logged
    (`StatsLogger`, logger `hybridkv.engine`); 0 turns it off.
    """

    def __init__(self, llm, log_stats_interval: float = 10.0):
        self.llm = llm
        self.log_stats_interval = log_stats_interval
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self.feeds: dict[str, RequestFeed] = {}  # engine thread only
        self.dead: Optional[BaseException] = None
        self._dead_lock = threading.Lock()  # no command slips in after the engine stopped
        self._stats_log = StatsLogger(log_stats_interval)
        self._thread = threading.Thread(target=self._run, name="hybridkv-engine", daemon=True)
        self._thread.start()

    # ---- any thread ---------------------------------------------------------------------------
    def submit(self, fn: Callable) -> concurrent.futures.Future:
        """Run `fn(llm)` on the engine thread between two steps; a Future of its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._dead_lock:
            if self.dead is None:
                self._cmds.put((fut, fn))
                return fut
        fut.set_exception(EngineDeadError(f"the engine is not running: {self.dead}"))
        return fut

    def abort(self, request_id: str) -> None:
        """Stop a request and free its memory at the engine's next turn (does not wait)."""
        self.submit(lambda llm: self._abort(llm, request_id))

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (requests still running are aborted)."""
        if self._thread.is_alive():
            self._cmds.put((None, None))
            self._thread.join(timeout)

    # ---- the engine thread (inside a submitted function) -----------------------------------------
    def add(self, llm, rid, ids, params, priority, cache_salt, sink: NewsSink) -> None:
        """Queue a request whose news goes to `sink`; bad input raises (nothing queued)."""
        llm.add_request(ids, params, request_id=rid, priority=priority, cache_salt=cache_salt)
        self.feeds[rid] = RequestFeed(sink)

    def _abort(self, llm, rid: str) -> None:
        feed = self.feeds.pop(rid, None)
        if feed is not None:
            llm.abort(rid)
            feed.sink.post(StepNews([], 0, 0, True))  # ends its reader

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
        by_kind: dict[type, list] = {}
        rid_of: dict[int, str] = {}
        for out in outs:
            feed = self.feeds.get(out.request_id)
            if feed is None:
                continue
            deltas, prompt_lps = [], None
            if not feed.prompt_logged and any(o.token_ids for o in out.outputs):  # prompt computed
                feed.prompt_logged = True
                prompt_lps = out.prompt_logprobs
                self._stats_log.on_prompt(len(out.prompt_token_ids) - out.num_cached_tokens)
            for o in out.outputs:
                sent = feed.sent.get(o.index, 0)
                done = o.finish_reason is not None
                if len(o.token_ids) == sent and (not done or o.index in feed.done):
                    continue
                if done:
                    feed.done.add(o.index)
                new_lp = o.logprobs[sent:] if o.logprobs is not None else None
                deltas.append(TokenDelta(o.index, list(o.token_ids[sent:]), new_lp, o.finish_reason,
                                         o.text if o.finish_reason is not None else None, o.stop_reason))
                feed.sent[o.index] = len(o.token_ids)
            if out.finished:
                del self.feeds[out.request_id]
            if deltas or out.finished:
                news = StepNews(deltas, len(out.prompt_token_ids), out.num_cached_tokens, out.finished,
                                prompt_lps)
                by_kind.setdefault(type(feed.sink), []).append((feed.sink, news))
                rid_of[id(feed.sink)] = out.request_id
        for kind, items in by_kind.items():
            for sink in kind.post_all(items):  # nobody will read these (a caller's event loop is gone)
                self._abort(self.llm, rid_of[id(sink)])

    def _shutdown(self, err: BaseException) -> None:
        with self._dead_lock:
            self.dead = err
        for rid, feed in list(self.feeds.items()):
            try:
                self.llm.abort(rid)
            except Exception:  # the engine may be broken; the callers still hear why
                pass
            feed.sink.post(EngineDeadError(str(err)))
        self.feeds.clear()
        while True:  # commands that arrived too late
            try:
                fut, _ = self._cmds.get_nowait()
            except queue.Empty:
                return
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_exception(EngineDeadError(f"the engine is not running: {err}"))
