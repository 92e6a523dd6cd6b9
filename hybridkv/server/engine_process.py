"""One data-parallel replica: a process that owns an `LLM` and its engine loop, driven over a pipe.

    process = ctx.Process(target=replica_main, args=(index, child_conn, model, llm_kwargs, interval, level, group))

The process builds its own `LLM` (which sets torch's threads as hybridkv/cpu_threads.py says),
joins the replicas' gloo group when given one (replica_group.py: moved snapshots travel through
it rank to rank), and runs the engine loop (engine_loop.py) that `AsyncLLM` runs; what differs
is its requests' sinks: a `PipeSink` sends each one's news to the pipe, tagged with the request
id, where AsyncLLM's `QueueSink` puts it on an asyncio queue. The main thread of the process
reads commands from the pipe; each runs on the engine thread between two steps and
answers `("reply", call_id, ok, value)`. Messages in (parent -> replica):

    ("add", cid, token_ids, params, request_id, priority, cache_salt)
    ("abort", request_id)                         no answer
    ("probe", cid, token_ids, cache_salt)      -> ReplicaProbe (hit tokens, load); changes nothing
    ("stats", cid)                              -> LLM.stats()
    ("export", cid, k, waiting, dst)            -> [MovedRequest]: up to k requests leave: running ones
                                                   (dst: the gloo rank their tensors go to, None: in
                                                   the message), or waiting ones that no cached
                                                   prefix holds here (as tokens)
    ("import", cid, MovedRequest)               -> None: the request continues here
    ("forget", [request_id])                    no answer: moved requests settled, drop their copies
    ("exit_on_next_add",)                       no answer: a test hook, the process dies at its next add
    ("close",)
and out: ("ready", ReplicaFacts) | ("failed", message) once, then ("news", request_id, StepNews
| EngineDeadError) and replies. The process exits when its engine dies or the parent goes away,
so the parent's reader sees the pipe close in every failure; on "close" it stops its LLM's
tensor-parallel ranks first. It ignores SIGINT: a Ctrl-C reaches the whole process group, and the
parent server decides how its replicas stop (http_server.py).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import traceback
from typing import Any, Optional

from .balancing import probe, requests_free_to_leave
from .engine_loop import EngineLoop, RequestFeed
from .replica_group import PendingSend, ReplicaGroup, SnapshotHeader
from .replica_messages import MovedRequest, ReplicaFacts
from .sink import PipeSink

log = logging.getLogger("hybridkv.replica")
_DEAD_POLL_S = 0.5  # how often an idle replica checks that its engine thread still runs


class ReplicaEngine(EngineLoop):
    """The engine loop with pipe sinks, plus the verbs a replica answers (engine thread)."""

    def __init__(self, llm, send, log_stats_interval: float, group: Optional[ReplicaGroup] = None):
        self._send, self.group = send, group
        self._outbox: dict[str, tuple[Any, Optional[PendingSend]]] = {}  # exported, not yet settled
        super().__init__(llm, log_stats_interval)

    def add_piped(self, llm, rid, ids, params, priority, cache_salt) -> None:
        """Queue a request whose news goes up the pipe."""
        self.add(llm, rid, ids, params, priority, cache_salt, PipeSink(rid, self._send))

    def export(self, llm, k: int, waiting: bool, dst: Optional[int]) -> list[MovedRequest]:
        """Up to k single-sequence requests leave this engine: running ones (most tokens left
        first; their tensors go to gloo rank `dst`, or in the message when None), or waiting ones
        that neither a cached prefix here nor a running request computing their prefix (burst
        rule) would serve (they move as tokens): balancing.requests_free_to_leave."""
        from hybridkv.scheduler.snapshot_io import snapshot_to_bytes

        moved = []
        for q in requests_free_to_leave(llm, self.feeds, waiting)[:k]:
            rid = q.request_id
            snap = llm.export_request(rid)
            feed = self.feeds.pop(rid)
            wire, sending = None, None
            if dst is not None and self.group is not None:
                try:
                    wire, sending = self.group.send_snapshot(snap, dst)
                except Exception as e:  # noqa: BLE001 - the destination is gone: bytes in the message
                    log.warning("request %s: gloo send to rank %d failed (%s); sending its bytes", rid, dst, e)
            if wire is None:
                wire = snapshot_to_bytes(snap)
            self._outbox[rid] = (snap, sending)  # imported back here if the destination fails
            moved.append(MovedRequest(rid, wire, dict(feed.sent), feed.prompt_logged))
        return moved

    def forget(self, request_ids) -> None:
        """Moved requests settled: drop their copies once their tensors left (main thread)."""
        for rid in request_ids:
            _, sending = self._outbox.pop(rid, (None, None))
            if sending is not None:
                sending.wait()

    def import_moved(self, llm, moved: MovedRequest) -> None:
        """Continue `moved` here; if the pools cannot take its KV and state now, it comes as tokens
        and is recomputed (never refused for lack of room)."""
        from hybridkv.scheduler.snapshot_io import snapshot_from_bytes

        wire = moved.snapshot
        if isinstance(wire, SnapshotHeader):  # receive first: the next header's tensors follow these
            snap = (self._outbox[moved.request_id][0] if wire.src == self.group.rank
                    else self.group.recv_snapshot(wire))
        else:
            snap = snapshot_from_bytes(wire)
        try:
            llm.import_request(snap)
        except RuntimeError:
            llm.import_request(dataclasses.replace(snap, num_computed_tokens=0, kv={}, conv={}, ssm={}))
        self.feeds[moved.request_id] = RequestFeed(PipeSink(moved.request_id, self._send), dict(moved.sent), set(),
                                                   moved.prompt_logged)


def replica_main(index: int, conn, model: str, llm_kwargs: dict, log_stats_interval: float,
                 log_level: int = logging.WARNING, group: Optional[tuple] = None) -> None:
    """The body of replica process `index` (multiprocessing spawn target); logs at the parent's
    level, each line tagged with the replica. `group`: (store port, world size, join timeout,
    receive timeout) of the replicas' gloo group to join as rank `index`, or None."""
    from hybridkv.llm import LLM

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us (its "close")
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s replica {index} %(name)s: %(message)s")

    lock = threading.Lock()  # the engine thread and this one both send

    def send(msg) -> None:
        with lock:
            try:
                conn.send(msg)
            except (BrokenPipeError, OSError):  # the parent went away; the loop below ends
                pass

    try:
        llm = LLM(model, **llm_kwargs)
    except BaseException as e:
        send(("failed", f"replica {index} could not build its LLM: {e}\n{traceback.format_exc()}"))
        return
    try:
        peers = None if group is None else ReplicaGroup.join(group[0], index, *group[1:])
    except BaseException as e:
        send(("failed", f"replica {index} could not join the replicas' gloo group on 127.0.0.1:{group[0]}: {e}"))
        return
    s = llm.stats()
    engine = ReplicaEngine(llm, send, log_stats_interval, peers)
    send(("ready", ReplicaFacts(llm.get_tokenizer(), getattr(llm.model, "max_model_len", None),
                                getattr(llm.model, "generation_defaults", None), llm.config.max_num_seqs,
                                s["kv_blocks_total"], s["state_slots_total"], os.getpid())))
    try:
        _serve(engine, conn, send)
    finally:
        engine.close()
        llm.close()


def _serve(engine: ReplicaEngine, conn, send) -> None:
    def reply(cid, fut) -> None:
        err = fut.exception()
        try:
            send(("reply", cid, err is None, fut.result() if err is None else err))
        except Exception as e:  # an answer that does not pickle still ends the caller's wait
            send(("reply", cid, False, RuntimeError(f"{err or e!r}")))

    verbs = {"add": lambda a: lambda llm: engine.add_piped(llm, a[2], a[0], a[1], a[3], a[4]),
             "probe": lambda a: lambda llm: probe(llm, a[0], a[1]),
             "stats": lambda a: lambda llm: llm.stats(),
             "export": lambda a: lambda llm: engine.export(llm, a[0], a[1], a[2]),
             "import": lambda a: lambda llm: engine.import_moved(llm, a[0])}
    exit_on_next_add = False
    while engine.dead is None:
        try:
            if not conn.poll(_DEAD_POLL_S):
                continue
            msg = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        verb = msg[0]
        if verb == "close":
            return
        if verb == "abort":
            engine.abort(msg[1])
            continue
        if verb == "forget":
            engine.forget(msg[1])
            continue
        if verb == "exit_on_next_add":
            exit_on_next_add = True
            continue
        if verb == "add" and exit_on_next_add:
            os._exit(3)  # as a crash would: no reply, the pipe closes
        cid = msg[1]
        fut = engine.submit(verbs[verb](msg[2:]))
        fut.add_done_callback(lambda f, cid=cid: reply(cid, f))
    log.error("replica engine stopped: %s", engine.dead)
