"""An OpenAI-compatible HTTP server over the engine (`hybridkv serve`), and data-parallel replicas.

Modules in dependency order (each imports only modules above it):
  news.py            what the engine tells a caller (StepNews, DeltaOutput, EngineDeadError)
  sink.py            `NewsSink`: where a request's news goes; `QueueSink` (asyncio), `PipeSink`
  engine_loop.py     `EngineLoop`: the LLM on its own engine thread, posting news to sinks
  request_stream.py  a caller's deltas of one request, read from a QueueSink (detokenizer.py)
  replica_*.py, balancing.py, engine_process.py, replica_set.py, router.py
                     data-parallel replicas: a process runs the engine loop with pipe sinks
  data_parallel.py   `DataParallelLLM`: N replica processes with AsyncLLM's interface
  async_llm.py       `AsyncLLM`: the engine loop with asyncio sinks (`create` picks either)
  protocol.py, openai_format.py, chat.py, metrics.py -> serving.py
  request_body.py    bytes -> a typed request (strict JSON, size limit) or an OpenAI-shaped error
  http_server.py     `serve_http`: uvicorn until SIGTERM / SIGINT, then drain and stop
  app.py             the routes and error handlers, `run_server`
  replicas.py        `run_replicas_server`: DataParallelLLM behind the app
"""
