"""The FastAPI app: routes, API-key check, OpenAI-shaped errors, and `run_server` (uvicorn).

    /v1/completions  /v1/chat/completions  (JSON, or SSE with "stream": true)
    /v1/models  /health  /metrics (Prometheus text)

Bad input is a 400 that names the field, the value and the limit (never a 500); a missing or
wrong API key a 401 (an unknown model is bad input too: a 400); a dead engine a 503.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask

from .async_llm import AsyncLLM
from .metrics import ServerMetrics
from .news import EngineDeadError
from .openai_format import APIError
from .protocol import ChatRequest, CompletionRequest
from .serving import Flow, OpenAIServing

log = logging.getLogger("hybridkv.server")


def _validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    """Pydantic's errors as one sentence per field: where, what was wrong, the value sent."""
    parts, param = [], None
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
            continue
        where = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in err.get("loc", ())
                        if x != "body").lstrip(".") or "body"
        param = param or where
        value = err.get("input")
        shown = "" if err.get("type") == "missing" else f" (got {value!r:.80})"
        parts.append(f"{where}: {err.get('msg')}{shown}")
    return "; ".join(parts[:5]) or "invalid request body", param


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


def create_app(engine: AsyncLLM, model_name: str, api_key: Optional[str] = None) -> FastAPI:
    """The app over a running `AsyncLLM` serving `model_name`; `api_key` guards /v1/*."""
    app = FastAPI(title="hybridkv", docs_url=None, redoc_url=None)
    metrics = ServerMetrics(model_name)
    serving = OpenAIServing(engine, model_name, metrics)
    started = int(time.time())
    app.state.engine, app.state.metrics = engine, metrics

    if api_key is not None:
        app.add_middleware(_APIKeyCheck, api_key=api_key)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, exc: EngineDeadError):
        return JSONResponse(APIError(str(exc), status=503).body(), status_code=503)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return JSONResponse(APIError(message, param=param).body(), status_code=400)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        if body.stream:
            return _sse(await serving.completions(body))
        return await _cancel_on_disconnect(request, _json(serving.completions(body)))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        if body.stream:
            return _sse(await serving.chat(body))
        return await _cancel_on_disconnect(request, _json(serving.chat(body)))

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
        return JSONResponse(e.body(), status_code=e.status)
    except EngineDeadError as e:
        return JSONResponse(APIError(str(e), status=503).body(), status_code=503)


def run_server(llm, model_name: str, host: str = "127.0.0.1", port: int = 8000,
               api_key: Optional[str] = None, log_stats_interval: float = 10.0) -> None:
    """Serve `llm` over HTTP until interrupted (Ctrl-C)."""
    import uvicorn

    s = llm.stats()  # before the engine thread owns the LLM
    engine = AsyncLLM(llm, log_stats_interval=log_stats_interval)
    log.info("serving %r on http://%s:%d: %d KV blocks, %d state slots%s", model_name, host, port,
             s["kv_blocks_total"], s["state_slots_total"], ", API key required" if api_key else "")
    try:
        uvicorn.run(create_app(engine, model_name, api_key), host=host, port=port, log_level="warning")
    finally:
        engine.close()
