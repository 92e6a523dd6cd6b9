"""`ReplicaSet`: N spawned engine processes (engine_process.py), their pipes, and calls to them.

    replicas = ReplicaSet(model, 2, llm_kwargs, log_stats_interval, on_news=..., on_death=..., gloo=True)
    replicas.call(i, "stats").result(timeout)   # a Future of replica i's answer
    replicas.send(i, ("abort", rid))             # no answer
    replicas.alive() -> [i, ...];  replicas.dead -> {i: why};  replicas.close()

One reader thread per replica takes what comes up its pipe: a reply resolves its Future, news
goes to `on_news(request_id, news)`. When the pipe closes (the process died, or its engine stopped
and it exited) the replica is marked dead, its unanswered calls fail with EngineDeadError naming
it and its exit code, and `on_death(i, why)` runs. Knows nothing of requests. With `gloo`, this
process serves a TCPStore on 127.0.0.1 (a free port) where the replicas meet to join one gloo
group, replica i as rank i (replica_group.py).
"""
from __future__ import annotations

import atexit
import concurrent.futures
import itertools
import logging
import multiprocessing as mp
import threading
import time
from multiprocessing import connection as mp_connection
from typing import Callable

from .engine_process import replica_main
from .news import EngineDeadError
from .replica_group import host_store
from .replica_messages import ReplicaFacts

log = logging.getLogger("hybridkv.replicas")


class ReplicaSet:
    """`size` processes each serving `LLM(model, **llm_kwargs)`; `startup_timeout` bounds the build;
    `gloo`: the replicas join one gloo group, whose receives `call_timeout` bounds."""

    def __init__(self, model: str, size: int, llm_kwargs: dict, log_stats_interval: float,
                 on_news: Callable, on_death: Callable, startup_timeout: float = 600.0, gloo: bool = False,
                 call_timeout: float = 60.0):
        self.size, self._on_news, self._on_death = size, on_news, on_death
        ctx = mp.get_context("spawn")  # a forked child would inherit torch's threads and locks
        self.gloo = gloo
        self._store = host_store(startup_timeout) if gloo else None
        group = None if self._store is None else (self._store.port, size, startup_timeout, call_timeout)
        # a replica with tensor-parallel ranks starts processes of its own, which a daemon may not;
        # then close() runs at exit, before multiprocessing would wait for it
        daemon = int(llm_kwargs.get("tensor_parallel_size", 1) or 1) == 1
        self._conns, self._procs = [], []
        for i in range(size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=replica_main, args=(i, child, model, llm_kwargs, log_stats_interval,
                                                       logging.getLogger().getEffectiveLevel(), group),
                            name=f"hybridkv-replica-{i}", daemon=daemon)
            p.start()
            child.close()  # only the child holds its end: its death closes the pipe here
            self._conns.append(parent)
            self._procs.append(p)
        self.closing = threading.Event()
        if not daemon:
            atexit.register(self.close)
        self.dead: dict[int, str] = {}
        self._lock = threading.Lock()  # pending calls and dead replicas change together
        self._send_locks = [threading.Lock() for _ in range(size)]
        self._pending: list[dict[int, concurrent.futures.Future]] = [{} for _ in range(size)]
        self._ids = itertools.count()
        self.facts: list[ReplicaFacts] = self._wait_ready(startup_timeout)
        for i in range(size):
            threading.Thread(target=self._read, args=(i,), name=f"hybridkv-replica-{i}-reader", daemon=True).start()

    def _wait_ready(self, timeout: float) -> list[ReplicaFacts]:
        """Every replica's facts; RuntimeError (all stopped) at the first that fails or after
        `timeout`. Waits on all at once: the others wait for a failed one in the gloo rendezvous."""
        deadline, facts = time.monotonic() + timeout, {}
        while len(facts) < self.size:
            waiting = [c for i, c in enumerate(self._conns) if i not in facts]
            ready = mp_connection.wait(waiting, max(0.0, deadline - time.monotonic()))
            if not ready:
                i = next(i for i in range(self.size) if i not in facts)
                ready, msg = [], ("failed", f"no answer within {timeout:.0f} s")
            for conn in ready:
                i = self._conns.index(conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    self._procs[i].join(2.0)
                    msg = ("failed", f"the process exited (code {self._procs[i].exitcode})")
                if msg[0] != "ready":
                    break
                facts[i] = msg[1]
            if msg[0] != "ready":
                self.close()
                raise RuntimeError(f"data-parallel replica {i} did not start: {msg[1]}")
        return [facts[i] for i in range(self.size)]

    def alive(self) -> list[int]:
        return [i for i in range(self.size) if i not in self.dead]

    def call(self, i: int, verb: str, *args) -> concurrent.futures.Future:
        """Send `(verb, call id, *args)` to replica i; a Future of its answer (EngineDeadError if
        it is gone, ValueError if the arguments do not pickle)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if i in self.dead:
                fut.set_exception(EngineDeadError(self.dead[i]))
                return fut
            cid = next(self._ids)
            self._pending[i][cid] = fut
        try:
            self.send(i, (verb, cid, *args))
        except Exception as e:  # it does not pickle (a callable in the params, say): nothing was sent
            with self._lock:
                self._pending[i].pop(cid, None)
            fut.set_exception(ValueError(f"cannot send {verb!r} to data-parallel replica {i}: {e}"))
        return fut

    def send(self, i: int, msg) -> None:
        with self._send_locks[i]:
            try:
                self._conns[i].send(msg)
            except (BrokenPipeError, OSError):  # the reader sees the pipe close and fails the calls
                pass

    def close(self, timeout: float = 10.0) -> None:
        """Stop every replica; waits at most `timeout` for each, then kills it."""
        self.closing.set()
        for i, p in enumerate(self._procs):
            if p.is_alive():
                self.send(i, ("close",))
        for p in self._procs:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join(timeout)

    def _read(self, i: int) -> None:
        conn = self._conns[i]
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "news":
                self._on_news(msg[1], msg[2])
            elif msg[0] == "reply":
                with self._lock:
                    fut = self._pending[i].pop(msg[1], None)
                if fut is not None and not fut.cancelled():  # a caller that gave up cancels it
                    (fut.set_result if msg[2] else fut.set_exception)(msg[3])
        self._died(i)

    def _died(self, i: int) -> None:
        p = self._procs[i]
        p.join(2.0)
        why = "was closed" if self.closing.is_set() else f"died (exit code {p.exitcode})"
        msg = f"data-parallel replica {i} (pid {p.pid}) {why}; its requests failed"
        if not self.closing.is_set():
            log.error(msg)
        with self._lock:
            self.dead[i] = msg
            pending, self._pending[i] = self._pending[i], {}
        for fut in pending.values():
            if not fut.cancelled():
                fut.set_exception(EngineDeadError(msg))
        self._on_death(i, msg)
