"""`hybridkv serve --data-parallel-size N`: a `DataParallelLLM` (data_parallel.py) behind the
HTTP app (app.py), until interrupted.

    run_replicas_server(path, "my-model", 2, llm_kwargs, port=8000)   # 0, or 2 if it cannot start

The single-engine twin is `app.run_server`; both stop cleanly on SIGTERM / SIGINT
(http_server.py), then close every replica (and its tensor-parallel ranks). `DataParallelLLM` is
importable from here too.
"""
from __future__ import annotations

import logging
from typing import Optional

from .app import create_app
from .data_parallel import DataParallelLLM
from .http_server import serve_http
from .request_body import HTTPLimits

log = logging.getLogger("hybridkv.replicas")


def run_replicas_server(model: str, model_name: str, data_parallel_size: int, llm_kwargs: dict,
                        host: str = "127.0.0.1", port: int = 8000, api_key: Optional[str] = None,
                        log_stats_interval: float = 10.0, limits: HTTPLimits = HTTPLimits(),
                        shutdown_timeout: float = 10.0) -> int:
    """`hybridkv serve --data-parallel-size N`: serve N replicas of `model` over HTTP until SIGTERM
    / SIGINT, then stop them all; 0 after a clean stop, 1 when the HTTP server could not start, 2
    (after logging why) when the replicas cannot start."""
    try:
        engine = DataParallelLLM(model, data_parallel_size, log_stats_interval, **llm_kwargs)
    except (ValueError, TypeError, RuntimeError) as e:
        log.error("cannot serve %s: %s", model, e)
        return 2
    f = engine.facts[0]
    log.info("serving %r on http://%s:%d with %d data-parallel replicas (pids %s): %d KV blocks, %d state "
             "slots each%s", model_name, host, port, data_parallel_size, ", ".join(str(x.pid) for x in engine.facts),
             f.kv_blocks_total, f.state_slots_total, ", API key required" if api_key else "")
    try:
        return serve_http(create_app(engine, model_name, api_key, limits), host, port, shutdown_timeout)
    finally:
        engine.close()
