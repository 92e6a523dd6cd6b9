"""The completion and chat flows: body -> prompt ids -> engine requests -> one JSON answer or an
SSE stream of OpenAI chunks ending in `data: [DONE]`.

Every request added is aborted if the flow ends before it finished (client gone, an error on a
sibling prompt), so a vanished client frees its blocks and slot at once. `drain` is the server's
stop (http_server.py): no new flow starts, running ones finish or end with finish_reason "abort".
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import AsyncIterator, Optional, Union

from .async_llm import AsyncLLM
from .chat import chat_prompt_ids
from .metrics import RequestTimer, ServerMetrics
from .news import DeltaOutput
from .openai_format import (SSE_DONE, APIError, chat_logprobs, completion_logprobs, envelope,
                            prompt_logprobs_json, sse, usage)
from .protocol import ChatRequest, CompletionRequest, resolve_max_tokens
from .request_stream import RequestStream

log = logging.getLogger("hybridkv.server")


class _Choice:
    """One output sequence as it accumulates: what the JSON answer (or the usage line) needs."""

    def __init__(self):
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[dict[int, float]] = []
        self.finish_reason: Optional[str] = None
        self.stop_reason = None  # the stop string or id that ended it (vLLM's field)
        self.text_offset = 0


class OpenAIServing:
    """Turns endpoint bodies into engine requests and engine deltas into OpenAI's shapes."""

    def __init__(self, engine: AsyncLLM, model_name: str, metrics: ServerMetrics,
                 max_prompts: Optional[int] = None):
        self.engine, self.model_name, self.metrics = engine, model_name, metrics
        self.max_prompts = max_prompts  # prompts one /v1/completions request may carry
        self.flows: set[Flow] = set()  # running: what a stop drains
        self.stopping = False
        self.tokenizer = engine.tokenizer
        model = getattr(engine.llm, "model", None)
        self.max_model_len: Optional[int] = getattr(model, "max_model_len", None)
        self.generation_defaults = getattr(model, "generation_defaults", None)  # per field, as vLLM
        self.max_num_seqs: Optional[int] = getattr(getattr(engine.llm, "config", None), "max_num_seqs", None)

    async def drain(self, timeout: float, hurry: Optional[asyncio.Event] = None) -> None:
        """Refuse new flows (503); wait up to `timeout` s (or until `hurry` is set) for the running
        ones to finish, then end the rest with finish_reason "abort"."""
        self.stopping = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self.flows:
            log.info("draining %d running HTTP requests for up to %.0f s", len(self.flows), timeout)
        while self.flows and loop.time() < deadline and not (hurry is not None and hurry.is_set()):
            await asyncio.sleep(0.05)
        if self.flows:
            log.warning("aborting %d HTTP requests still running at shutdown (finish_reason 'abort')",
                        len(self.flows))
        for flow in list(self.flows):
            flow.end("abort")

    def check_model(self, name: str) -> None:
        if self.stopping:
            raise APIError("the server is shutting down: send the request to another server or retry later",
                           status=503)
        if name != self.model_name:
            raise APIError(f"model {name!r} is not served here; this server serves {self.model_name!r} "
                           f"(see /v1/models)", param="model")

    def _check_n(self, body) -> None:
        if self.max_num_seqs is not None and isinstance(body.n, int) and body.n > self.max_num_seqs:
            raise APIError(f"n={body.n} is more than this server's max_num_seqs {self.max_num_seqs}: "
                           f"ask for at most {self.max_num_seqs} sequences", param="n")

    def _prompt_ids(self, prompt: Union[str, list[int]]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError("this checkpoint has no tokenizer: send the prompt as a list of token ids",
                               param="prompt")
            return list(self.tokenizer(prompt)["input_ids"])
        return [int(t) for t in prompt]

    def _max_tokens(self, requested: Optional[int], prompt_len: int) -> Optional[int]:
        if self.max_model_len is None:
            return requested if requested is not None else 16
        return resolve_max_tokens(requested, prompt_len, self.max_model_len)

    async def _start(self, rid: str, prompts: list[list[int]], requested_max: Optional[int], body,
                     num_logprobs: Optional[int]) -> list[RequestStream]:
        """Add one engine request per prompt (ids `rid-i`); all or none (a bad one aborts the rest)."""
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                if not ids:
                    raise APIError("the prompt is empty: give at least one token", param="prompt")
                params = body.sampling_params(self._max_tokens(requested_max, len(ids)), num_logprobs,
                                              self.generation_defaults)
                try:
                    streams.append(await self.engine.add_request(ids, params, f"{rid}-{i}", body.priority,
                                                                 body.cache_salt))
                except ValueError as e:
                    raise APIError(str(e), param="prompt" if len(prompts) == 1 else f"prompt[{i}]") from None
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams

    # ---- endpoints -----------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest):
        self.check_model(body.model)
        body.refuse_unsupported()
        self._check_n(body)
        prompts = [self._prompt_ids(p) for p in body.prompts(self.max_prompts)]
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = await self._start(rid, prompts, body.max_tokens, body, body.logprobs)
        flow = Flow(self, rid, "text_completion", body, streams, body.logprobs)
        return flow if body.stream else await flow.collect()

    async def chat(self, body: ChatRequest):
        self.check_model(body.model)
        body.refuse_unsupported()
        self._check_n(body)
        messages = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(body.messages)]
        ids = chat_prompt_ids(self.tokenizer, messages, body.add_generation_prompt, body.chat_template_kwargs)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self._start(rid, [ids], body.requested_max_tokens, body, body.num_logprobs)
        flow = Flow(self, rid, "chat.completion", body, streams, body.num_logprobs)
        return flow if body.stream else await flow.collect()


class Flow:
    """One HTTP request's engine requests (one per prompt, n sequences each) from start to end:
    `collect()` for one JSON answer, `sse()` for a stream; `abort()` stops what is unfinished."""

    def __init__(self, serving: OpenAIServing, rid: str, kind: str, body, streams: list[RequestStream],
                 num_logprobs: Optional[int]):
        self.s, self.rid, self.kind, self.body, self.streams = serving, rid, kind, body, streams
        self.k = num_logprobs
        self.n = body.n
        self.choices = [_Choice() for _ in range(len(streams) * self.n)]
        self.timers = [RequestTimer(serving.metrics) for _ in streams]
        self.prompt_tokens = [0] * len(streams)
        self.cached_tokens = [0] * len(streams)
        self.prompt_logprobs: list[Optional[list]] = [None] * len(streams)
        serving.flows.add(self)
        if serving.stopping:  # it started while the server was stopping
            self.end("abort")

    def end(self, reason: str) -> None:
        """Finish every unfinished sequence now with `reason` (its engine requests are aborted)."""
        for st in self.streams:
            st.end(reason)

    def abort(self) -> None:
        """Abort every request of this flow that has not finished (idempotent)."""
        self.s.flows.discard(self)
        for st in self.streams:
            st.abort()

    async def _deltas(self) -> AsyncIterator[tuple[int, DeltaOutput]]:
        """(prompt index, delta) from all streams as they come; aborts what is left on exit."""
        queue: asyncio.Queue = asyncio.Queue()
        end = object()

        async def pump(i: int, st: RequestStream):
            try:
                async for d in st:
                    await queue.put((i, d))
            except Exception as e:  # the engine died: the flow reports it
                await queue.put((i, e))
            finally:
                await queue.put((i, end))

        tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(self.streams)]
        try:
            left = len(tasks)
            while left:
                i, d = await queue.get()
                if d is end:
                    left -= 1
                elif isinstance(d, Exception):
                    raise APIError(f"the engine failed: {d}", status=503)
                else:
                    yield i, self._account(i, d)
        finally:
            for t in tasks:
                t.cancel()
            self.abort()

    def _account(self, i: int, d: DeltaOutput) -> DeltaOutput:
        c = self.choices[i * self.n + d.index]
        c.token_ids += d.token_ids
        c.text += d.text
        if d.logprobs:
            c.logprobs += d.logprobs
        self.prompt_tokens[i], self.cached_tokens[i] = d.num_prompt_tokens, d.num_cached_tokens
        if d.prompt_logprobs is not None:
            self.prompt_logprobs[i] = d.prompt_logprobs
        timer = self.timers[i]
        timer.on_tokens(d.index, len(d.token_ids))
        if d.finish_reason is not None:
            c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
            timer.on_finish(d.finish_reason)
            own = self.choices[i * self.n:(i + 1) * self.n]
            if all(x.finish_reason is not None for x in own):
                e2e = timer.done(d.num_prompt_tokens)
                ttft = timer.ttft
                log.info("request %s-%d finished: %d prompt tokens (%d cached), %d generated, finish %s, "
                         "ttft %s, e2e %.3fs", self.rid, i, d.num_prompt_tokens, d.num_cached_tokens,
                         sum(len(x.token_ids) for x in own), ",".join(x.finish_reason for x in own),
                         "-" if ttft is None else f"{ttft:.3f}s", e2e)
        return d

    def _usage(self) -> dict:
        return usage(sum(self.prompt_tokens), sum(len(c.token_ids) for c in self.choices),
                     sum(self.cached_tokens))

    def _logprobs(self, c: _Choice, token_ids: list[int], logprobs) -> Optional[dict]:
        if self.k is None or not logprobs:
            return None
        if self.kind == "text_completion":
            out = completion_logprobs(self.s.tokenizer, token_ids, logprobs, self.k, c.text_offset)
            c.text_offset = out["text_offset"][-1] + len(out["tokens"][-1]) if out["tokens"] else c.text_offset
            return out
        return chat_logprobs(self.s.tokenizer, token_ids, logprobs, self.k)

    async def collect(self) -> dict:
        async for _ in self._deltas():
            pass
        out = []
        for idx, c in enumerate(self.choices):
            choice = {"index": idx, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                      "logprobs": self._logprobs(c, c.token_ids, c.logprobs)}
            if self.kind == "text_completion":
                choice["text"] = c.text
                if self.body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(self.prompt_logprobs[idx // self.n])
            else:
                choice["message"] = {"role": "assistant", "content": c.text}
            if self.body.return_token_ids:
                choice["token_ids"] = c.token_ids
            out.append(choice)
        answer = {**envelope(self.kind, self.rid, self.s.model_name, out), "usage": self._usage()}
        if self.kind != "text_completion" and self.body.prompt_logprobs is not None:
            answer["prompt_logprobs"] = prompt_logprobs_json(self.prompt_logprobs[0])
        return answer

    async def sse(self) -> AsyncIterator[str]:
        """The SSE body: one chunk per delta, then a usage chunk if asked, then [DONE]."""
        chat = self.kind == "chat.completion"
        kind = "chat.completion.chunk" if chat else "text_completion"
        model, created = self.s.model_name, int(time.time())
        quiet_ok = not self.body.return_token_ids and self.k is None  # nothing but text to carry
        if chat:  # the role comes first, once per choice
            for idx in range(len(self.choices)):
                yield sse(envelope(kind, self.rid, model, [
                    {"index": idx, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}], created))
        try:
            async for i, d in self._deltas():
                if not d.text and d.finish_reason is None and quiet_ok:
                    continue  # text held back (a split character or a possible stop string)
                idx = i * self.n + d.index
                choice = {"index": idx, "logprobs": self._logprobs(self.choices[idx], d.token_ids, d.logprobs),
                          "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}
                if chat:
                    choice["delta"] = {"content": d.text} if d.text else {}
                else:
                    choice["text"] = d.text
                if self.body.return_token_ids:
                    choice["token_ids"] = d.token_ids
                yield sse(envelope(kind, self.rid, model, [choice], created))
        except APIError as e:
            yield sse(e.body())
        if self.body.stream_options is not None and self.body.stream_options.include_usage:
            yield sse({**envelope(kind, self.rid, model, [], created), "usage": self._usage()})
        yield SSE_DONE
