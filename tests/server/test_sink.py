"""The sink interface (server/sink.py): a QueueSink hands news to its event loop (one wake-up per
loop for a whole step), refuses once that loop closed; a PipeSink sends it tagged."""
from __future__ import annotations

import asyncio

from hybridkv.server.news import StepNews
from hybridkv.server.sink import PipeSink, QueueSink


def _news(finished: bool = False) -> StepNews:
    return StepNews([], 3, 0, finished)


def test_queue_sinks_of_one_loop_are_woken_once_and_read_in_order():
    async def main():
        loop = asyncio.get_running_loop()
        sinks = [QueueSink() for _ in range(3)]
        calls = []
        original = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (calls.append(a), original(*a))[1]
        try:
            refused = QueueSink.post_all([(s, _news(i == 2)) for i, s in enumerate(sinks)])
        finally:
            del loop.call_soon_threadsafe
        assert refused == [] and len(calls) == 1
        got = [await asyncio.wait_for(s.queue.get(), 1) for s in sinks]
        assert [n.finished for n in got] == [False, False, True]

    asyncio.run(main())


def test_a_queue_sink_whose_loop_closed_refuses():
    async def make():
        return QueueSink()

    loop = asyncio.new_event_loop()
    sink = loop.run_until_complete(make())
    loop.close()
    assert sink.post(_news()) is False
    assert QueueSink.post_all([(sink, _news())]) == [sink]


def test_a_pipe_sink_sends_its_news_tagged_with_the_request():
    sent = []
    sink = PipeSink("req-7", sent.append)
    news = _news(True)
    assert sink.post(news) is True and PipeSink.post_all([(sink, news)]) == []
    assert sent == [("news", "req-7", news)] * 2
