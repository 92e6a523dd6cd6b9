"""An OpenAI-compatible HTTP server over the engine (`hybridkv serve`).

`AsyncLLM` (async_llm.py) owns the `LLM` on one engine thread and streams delta outputs to
asyncio callers; `app.py` is the FastAPI app; `protocol.py` the request bodies; `openai_format.py`
the response and error shapes; `metrics.py` the Prometheus metrics; `detokenizer.py` the
incremental detokenizer that streamed text goes through.
"""
