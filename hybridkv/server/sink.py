"""`NewsSink`: where the engine loop posts one request's news, and its two kinds.

    sink = QueueSink()                 # on the caller's event loop; read `await sink.queue.get()`
    sink = PipeSink(request_id, send)  # in a replica process: `send(("news", request_id, news))`
    sink.post(news) -> False when nobody can receive it any more

News is a `StepNews`, or the exception that ended the request (news.py). The engine loop posts
on its own thread, once per request per step, through `post_all`, so a kind can batch: a
`QueueSink` wakes each event loop once per step however many of its requests advanced.
"""
from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import Callable


class NewsSink(ABC):
    """Receives one request's news on the engine thread."""

    @abstractmethod
    def post(self, news) -> bool:
        """Hand `news` on; False when nobody can receive it any more (abort the request)."""

    @classmethod
    def post_all(cls, items: list[tuple["NewsSink", object]]) -> list["NewsSink"]:
        """Post (sink, news) pairs whose sinks are all of this kind; the sinks that refused."""
        return [sink for sink, news in items if not sink.post(news)]


class QueueSink(NewsSink):
    """An asyncio queue read on the event loop that made the sink (make it on that loop)."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def post(self, news) -> bool:
        return _hand_to(self.loop, [(self.queue, news)])

    @classmethod
    def post_all(cls, items: list[tuple["QueueSink", object]]) -> list["QueueSink"]:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for sink, news in items:
            by_loop.setdefault(sink.loop, []).append((sink, news))
        refused = []
        for loop, pairs in by_loop.items():
            if not _hand_to(loop, [(sink.queue, news) for sink, news in pairs]):
                refused += [sink for sink, _ in pairs]
        return refused


class PipeSink(NewsSink):
    """Sends `("news", request_id, news)` through `send` (a replica's pipe to its parent)."""

    def __init__(self, request_id: str, send: Callable[[tuple], None]):
        self.request_id, self._send = request_id, send

    def post(self, news) -> bool:
        self._send(("news", self.request_id, news))
        return True


def _put_all(items) -> None:
    for q, news in items:
        q.put_nowait(news)


def _hand_to(loop: asyncio.AbstractEventLoop, items) -> bool:
    """Put (queue, news) pairs on `loop`'s thread; False when that loop is closed."""
    try:
        loop.call_soon_threadsafe(_put_all, items)
        return True
    except RuntimeError:
        return False
