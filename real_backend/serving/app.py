"""The HTTP front end (FastAPI): OpenAI's /v1/completions and /v1/chat/completions (SSE
streaming included), /v1/models, /health and /metrics, over the pipe to the engine process."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from policies.request import Request as EngineRequest
from real_backend.serving.engine_client import EngineClient, Event, Stream
from real_backend.serving.front_end import ServedModel
from real_backend.serving.metrics import FrontEndMetrics
from real_backend.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    completion_body,
    parse,
    usage,
    usage_chunk,
)
from real_backend.serving.tokenizer import Tokenizer


def build_app(model: ServedModel, tokenizer: Tokenizer, engine: EngineClient,
              metrics: FrontEndMetrics) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.attach(asyncio.get_running_loop())
        yield

    app = FastAPI(title="schedlab", docs_url=None, redoc_url=None, lifespan=lifespan)
    ids = itertools.count()
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.get("/health")
    async def health() -> Response:
        if engine.error:
            return JSONResponse({"status": "error", "error": engine.error}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": model.name, "object": "model", "created": created, "owned_by": "schedlab",
            "max_model_len": model.max_model_len}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.text() + await engine.engine_metrics(),
                        media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse(CompletionRequest, await _json(request))
        prompt = req.single_prompt()
        if isinstance(prompt, str):
            prompt_ids = tokenizer.encode_prompt(prompt)
        else:
            bad = [i for i in prompt if not 0 <= i < model.vocab_size]
            if bad:
                raise APIError(f"prompt: token id {bad[0]} is outside the model's vocabulary "
                               f"[0, {model.vocab_size})", param="prompt")
            prompt_ids = list(prompt)
        return await _generate(request, req, prompt_ids, req.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse(ChatCompletionRequest, await _json(request))
        prompt_ids = tokenizer.encode_chat(req.turns())
        return await _generate(request, req, prompt_ids, req.output_limit, chat=True)

    async def _generate(http: Request, req: Any, prompt_ids: list[int], max_tokens: int | None,
                        chat: bool) -> Response:
        if req.model is not None and req.model != model.name:
            raise APIError(f"model {req.model!r} is not served here; this server serves "
                           f"{model.name!r}", param="model")
        req.sampling_check(model.sampling)
        n = len(prompt_ids)
        room = model.max_model_len - n
        if room < 1:
            raise APIError(f"the prompt has {n} tokens; model.max_model_len is "
                           f"{model.max_model_len}, leaving no room for output", param="prompt")
        max_tokens = room if max_tokens is None else max_tokens
        if max_tokens > room:
            raise APIError(f"max_tokens {max_tokens} + the prompt's {n} tokens exceed "
                           f"model.max_model_len {model.max_model_len}", param="max_tokens")
        stop = None if req.ignore_eos else tokenizer.stop_id(chat)
        engine_req = EngineRequest(next(ids), 0.0, n, max_tokens, prompt_ids, eos_token_id=stop)
        metrics.received.inc()
        try:
            stream = engine.submit(engine_req)
        except RuntimeError as err:
            raise APIError(str(err), status=503, kind="service_unavailable") from None
        done = False
        watcher = asyncio.create_task(_watch(http, stream))
        try:
            first = await stream.queue.get()
            if first.error:  # the scheduler's refusal, or the server's state
                raise (APIError(first.error, 503, "service_unavailable") if first.unavailable
                       else APIError(first.error))
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{engine_req.request_id}"
            if req.stream:
                done = True  # the stream's generator owns the request (and the watcher) now
                return StreamingResponse(_sse(stream, watcher, req, rid, chat, stop),
                                         media_type="text/event-stream")
            try:
                text, finish, count = await _collect(stream, stop)
            finally:
                watcher.cancel()
            done = True
            body = completion_body(rid, model.name, chat, text, finish, usage(n, count),
                                   chunk=False)
            return JSONResponse(body)
        finally:
            if not done:  # refused, failed, the client gone, or the handler cancelled
                watcher.cancel()
                engine.abort(engine_req.request_id)

    async def _watch(http: Request, stream: Stream) -> None:
        """The client's hang-up, seen as it happens (not at the next write): the request is
        aborted, and its reader told to stop."""
        while (await http.receive())["type"] != "http.disconnect":
            pass
        engine.abort(stream.request.request_id)
        stream.queue.put_nowait(Event(error=GONE))

    async def _collect(stream: Stream, stop: int | None) -> tuple[str, str, int]:
        detok = tokenizer.detokenizer(stop)
        parts, count = [], 0
        while True:
            ev = await stream.queue.get()
            if ev.error is GONE:
                raise APIError("the client disconnected", 499, "client_closed_request")
            _raise_engine_error(ev)
            count += len(ev.token_ids)
            parts.append(detok(ev.token_ids, final=ev.finish is not None))
            if ev.finish:
                return "".join(parts), ev.finish, count

    async def _sse(stream: Stream, watcher: asyncio.Task, req: Any, rid: str, chat: bool,
                   stop: int | None) -> AsyncIterator[str]:
        detok = tokenizer.detokenizer(stop)
        n = stream.request.prompt_len
        count, first, finished = 0, True, False
        try:
            while True:
                ev = await stream.queue.get()
                if ev.error is GONE:  # aborted already; nobody to write to
                    finished = True
                    return
                if ev.error:  # the engine failed mid-stream: OpenAI's error object, then stop
                    yield _data(APIError(ev.error, 500, "server_error").body())
                    finished = True
                    return
                count += len(ev.token_ids)
                text = detok(ev.token_ids, final=ev.finish is not None)
                use = usage(n, count) if req.continuous_usage else None
                if text or ev.finish or first:
                    if ev.token_ids:
                        metrics.sse_chunks.inc()
                    yield _data(completion_body(rid, model.name, chat, text, ev.finish, use,
                                                chunk=True, first=first))
                    first = False
                if ev.finish:
                    break
            if req.include_usage:
                yield _data(usage_chunk(rid, model.name, chat, usage(n, count)))
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            watcher.cancel()
            if not finished:  # the generator was closed early (a write to a gone client)
                engine.abort(stream.request.request_id)

    return app


# what a watcher puts on a request's queue when its client has hung up
GONE = "the client disconnected"


def _raise_engine_error(ev: Event) -> None:
    if ev.error:
        raise APIError(ev.error, 500, "server_error")


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(f"the request body is not JSON: {err}") from None

