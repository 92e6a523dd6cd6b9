"""The FastAPI app: routes, API-key check, OpenAI-shaped errors, and `run_server` (uvicorn).

    /v1/completions  /v1/chat/completions  (JSON, or SSE with "stream": true)
    /v1/models  /health  /metrics (Prometheus text)

Every error is OpenAI's shape, {"error": {"message", "type", "param", "code"}}: bad input is a 400
that names the field, the value and the limit (request_body.py parses, protocol.py checks; an
unknown model is bad input too); a body over `HTTPLimits.max_body_bytes` a 413; a missing or wrong
API key a 401; an unknown path a 404; a dead or stopping engine a 503; a bug of ours a 500 that
says so. SIGTERM / SIGINT stop the server cleanly (http_server.py).
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from .async_llm import AsyncLLM
from .http_server import serve_http
from .metrics import ServerMetrics
from .news import EngineDeadError
from .openai_format import APIError
from .protocol import ChatRequest, CompletionRequest
from .request_body import BodyGone, HTTPLimits, read_body
from .serving import Flow, OpenAIServing

log = logging.getLogger("hybridkv.server")


async def _until_disconnected(request: Request) -> None:
    while True:
        if (await request.receive())["type"] == "http.disconnect":
            return


async def _cancel_on_disconnect(request: Request, work):
    """Run `work` (a non-streaming answer); if the client goes away first, cancel it, which aborts
    its engine requests. Streams need no help: Starlette cancels a stream whose client left."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        log.info("client disconnected: request cancelled")
        return Response(status_code=499)
    return task.result()


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def create_app(engine: AsyncLLM, model_name: str, api_key: Optional[str] = None,
               limits: HTTPLimits = HTTPLimits()) -> FastAPI:
    """The app over a running `AsyncLLM` (or DataParallelLLM) serving `model_name`; `api_key`
    guards /v1/*; `limits` bound each request's body and prompts."""
    app = FastAPI(title="hybridkv", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ServerMetrics(model_name)
    serving = OpenAIServing(engine, model_name, metrics, limits.max_prompts)
    started = int(time.time())
    app.state.engine, app.state.metrics, app.state.serving = engine, metrics, serving

    if api_key is not None:
        app.add_middleware(_APIKeyCheck, api_key=api_key)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return _error(exc)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, exc: EngineDeadError):
        return _error(APIError(str(exc), status=503))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):  # no such path, method not allowed
        what = {404: f"no such endpoint: {request.url.path} (see /v1/models, /v1/completions, "
                     f"/v1/chat/completions)",
                405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        return JSONResponse(APIError(what, status=exc.status_code).body(), status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(Exception)
    async def bug(_: Request, exc: Exception):  # a bug of ours: still OpenAI's shape, and logged
        log.exception("internal error while serving a request")
        return _error(APIError(f"internal server error: {type(exc).__name__}: {exc}", status=500))

    async def answer(request: Request, model, endpoint):
        try:
            body = await read_body(request, model, limits)
        except BodyGone:
            return Response(status_code=499)
        if body.stream:
            return _sse(await endpoint(body))
        return await _cancel_on_disconnect(request, _json(endpoint(body)))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, CompletionRequest, serving.completions)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await answer(request, ChatRequest, serving.chat)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": started,
                                            "owned_by": "hybridkv", "max_model_len": serving.max_model_len}]}

    @app.get("/health")
    async def health():
        if engine.dead is not None:
            return JSONResponse(APIError(f"the engine stopped: {engine.dead}", status=503).body(),
                                status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(await engine.stats()), media_type=CONTENT_TYPE_LATEST)

    return app


class _APIKeyCheck:
    """ASGI middleware: /v1/* needs 'Authorization: Bearer <key>' (401 otherwise); /health and
    /metrics stay open for probes and scrapers."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                err = APIError("missing or wrong API key: send 'Authorization: Bearer <key>'", status=401)
                return await JSONResponse(err.body(), status_code=401)(scope, receive, send)
        await self.app(scope, receive, send)


def _sse(flow: Flow) -> StreamingResponse:
    # the background task runs however the stream ends: a client gone before the first event
    # still has its requests aborted
    return StreamingResponse(flow.sse(), media_type="text/event-stream", background=BackgroundTask(flow.abort),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _json(work) -> JSONResponse:
    try:
        return JSONResponse(await work)
    except APIError as e:
        return _error(e)
    except EngineDeadError as e:
        return _error(APIError(str(e), status=503))


def run_server(llm, model_name: str, host: str = "127.0.0.1", port: int = 8000,
               api_key: Optional[str] = None, log_stats_interval: float = 10.0,
               limits: HTTPLimits = HTTPLimits(), shutdown_timeout: float = 10.0) -> int:
    """Serve `llm` over HTTP until SIGTERM / SIGINT (http_server.py: running requests get
    `shutdown_timeout` s to finish, then end with finish_reason "abort"); then stop the engine
    and the LLM's tensor-parallel ranks. 0 after a clean stop, 1 when the server could not start."""
    s = llm.stats()  # before the engine thread owns the LLM
    engine = AsyncLLM(llm, log_stats_interval=log_stats_interval)
    log.info("serving %r on http://%s:%d: %d KV blocks, %d state slots%s", model_name, host, port,
             s["kv_blocks_total"], s["state_slots_total"], ", API key required" if api_key else "")
    try:
        return serve_http(create_app(engine, model_name, api_key, limits), host, port, shutdown_timeout)
    finally:
        engine.close()
        llm.close()
