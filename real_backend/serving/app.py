"""The HTTP front end (FastAPI): OpenAI's /v1/completions and /v1/chat/completions (SSE
streaming included), /v1/models, /health and /metrics, over the pipe to the engine process;
every request passes the Guard (its Host, its API key, its body's size) first, and every error
reply is OpenAI's error object."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from policies.request import Request as EngineRequest
from real_backend.serving.engine_client import EngineClient, Event, Stream
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
from real_backend.serving.settings import HTTPSettings, ServedModel
from real_backend.serving.tokenizer import Detokenizer, StopStrings, Tokenizer

log = logging.getLogger("uvicorn.error")
access_log = logging.getLogger("schedlab.access")  # a line per request (front_end.py)


def build_app(model: ServedModel, tokenizer: Tokenizer, engine: EngineClient,
              metrics: FrontEndMetrics, settings: HTTPSettings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.attach(asyncio.get_running_loop())
        yield

    app = FastAPI(title="schedlab", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.add_middleware(Guard, settings=settings)
    ids = itertools.count()
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)  # routing's 404 and 405
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        body = APIError(f"{request.method} {request.url.path}: {err.detail}",
                        err.status_code).body()
        return JSONResponse(body, status_code=err.status_code, headers=err.headers)

    @app.exception_handler(Exception)  # a bug: the JSON reply, and the traceback in the log
    async def server_error(_: Request, err: Exception) -> JSONResponse:
        body = APIError(f"internal server error ({type(err).__name__})", 500,
                        "server_error").body()
        return JSONResponse(body, status_code=500)

    @app.get("/health")
    async def health() -> Response:
        """503 once the engine has failed, or its policy has stalled (requests failed for want
        of a batch, engine_client.py): a server that cannot serve them says so."""
        reason = engine.error or engine.stalled
        if reason:
            return JSONResponse({"status": "error", "error": reason}, status_code=503)
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
        req = parse(CompletionRequest, await _body(request))
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
        req = parse(ChatCompletionRequest, await _body(request))
        prompt_ids = tokenizer.encode_chat(req.turns())
        return await _generate(request, req, prompt_ids, req.output_limit, chat=True)

    async def _generate(http: Request, req: Any, prompt_ids: list[int], max_tokens: int | None,
                        chat: bool) -> Response:
        if req.model is not None and req.model != model.name:
            raise APIError(f"model {req.model!r} is not served here; this server serves "
                           f"{model.name!r}", param="model")
        sampling = req.sampling(model.sampling)
        n = len(prompt_ids)
        room = model.max_model_len - n
        if room < 1:
            raise APIError(f"the prompt has {n} tokens; model.max_model_len is "
                           f"{model.max_model_len}, leaving no room for output", param="prompt")
        if max_tokens is None:  # what fits the model's context and, alone, the KV cache
            max_tokens = model.max_request_tokens - n
            if max_tokens < 1:
                raise APIError(f"the prompt has {n} tokens; this server admits at most "
                               f"{model.max_request_tokens} tokens of prompt and output per "
                               "request (its KV cache), leaving no room for output",
                               param="prompt")
        elif max_tokens > room:
            raise APIError(f"max_tokens {max_tokens} + the prompt's {n} tokens exceed "
                           f"model.max_model_len {model.max_model_len}", param="max_tokens")
        stop = None if req.ignore_eos else tokenizer.stop_id(chat)
        engine_req = EngineRequest(next(ids), 0.0, n, max_tokens, prompt_ids, eos_token_id=stop,
                                   sampling=sampling)
        metrics.received.inc()
        try:
            stream = engine.submit(engine_req)
        except RuntimeError as err:
            raise APIError(str(err), status=503, kind="service_unavailable") from None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{engine_req.request_id}"
        reply = Reply(rid, engine_req, tokenizer.detokenizer(stop),
                      StopStrings(req.stop_strings()), engine.clock)
        done = False
        watcher = asyncio.create_task(_watch(http, stream))
        try:
            first = await stream.queue.get()
            if first.error:  # the scheduler's refusal, or the server's state
                reply.finish = "error"
                raise (APIError(first.error, 503, "service_unavailable") if first.unavailable
                       else APIError(first.error))
            if req.stream:
                done = True  # the stream's generator owns the request (and the watcher) now
                return StreamingResponse(_sse(stream, watcher, req, reply, chat),
                                         media_type="text/event-stream")
            try:
                text = await _collect(stream, reply)
            finally:
                watcher.cancel()
            done = True
            reply.log()
            body = completion_body(rid, model.name, chat, text, reply.finish,
                                   usage(n, reply.count), chunk=False)
            return JSONResponse(body)
        finally:
            if not done:  # refused, failed, the client gone, or the handler cancelled
                watcher.cancel()
                engine.abort(engine_req.request_id)
                reply.log()

    async def _watch(http: Request, stream: Stream) -> None:
        """The client's hang-up, seen as it happens (not at the next write): the request is
        aborted, and its reader told to stop."""
        while (await http.receive())["type"] != "http.disconnect":
            pass
        engine.abort(stream.request.request_id)
        stream.queue.put_nowait(Event(error=GONE))

    def _take(stream: Stream, reply: Reply, ev: Event) -> str:
        """``ev``'s text for the client; a stop sequence found in it ends the request in the
        engine too (its KV blocks freed at the engine's next iteration)."""
        text = reply.take(ev)
        if reply.finish == "stop" and ev.finish is None:
            engine.finish(stream.request.request_id)
        return text

    async def _collect(stream: Stream, reply: Reply) -> str:
        parts = []
        while True:
            ev = await stream.queue.get()
            if ev.error is GONE:
                reply.finish = "disconnected"
                raise APIError("the client disconnected", 499, "client_closed_request")
            if ev.error:
                reply.finish = "error"
                raise APIError(ev.error, 500, "server_error")
            parts.append(_take(stream, reply, ev))
            if reply.finish:
                return "".join(parts)

    async def _sse(stream: Stream, watcher: asyncio.Task, req: Any, reply: Reply,
                   chat: bool) -> AsyncIterator[str]:
        n, rid = stream.request.prompt_len, reply.rid
        first, finished = True, False
        try:
            while True:
                ev = await stream.queue.get()
                if ev.error is GONE:  # aborted already; nobody to write to
                    reply.finish = "disconnected"
                    finished = True
                    return
                if ev.error:  # the engine failed mid-stream: OpenAI's error object, then stop
                    reply.finish = "error"
                    yield _data(APIError(ev.error, 500, "server_error").body())
                    finished = True
                    return
                text = _take(stream, reply, ev)
                use = usage(n, reply.count) if req.continuous_usage else None
                if text or reply.finish or first:
                    if ev.token_ids:
                        metrics.sse_chunks.inc()
                    yield _data(completion_body(rid, model.name, chat, text, reply.finish, use,
                                                chunk=True, first=first))
                    first = False
                if reply.finish:
                    break
            if req.include_usage:
                yield _data(usage_chunk(rid, model.name, chat, usage(n, reply.count)))
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            watcher.cancel()
            if not finished:  # the generator was closed early (a write to a gone client)
                engine.abort(stream.request.request_id)
                reply.finish = reply.finish or "disconnected"
            reply.log()

    return app


# what a watcher puts on a request's queue when its client has hung up
GONE = "the client disconnected"


class Reply:
    """One request's reply as its tokens arrive: the text (detokenized, cut before a stop
    sequence), the tokens counted, the finish reason, and its access-log line."""

    def __init__(self, rid: str, request: EngineRequest, detok: Detokenizer, stops: StopStrings,
                 clock: Callable[[], float]) -> None:
        self.rid, self.request, self.detok, self.stops, self.clock = (rid, request, detok,
                                                                        stops, clock)
        self.count = 0  # output tokens (up to the one that completed a stop sequence)
        self.finish: str | None = None
        self.first_token: float | None = None  # on the engine clock
        self._logged = False

    def take(self, ev: Event) -> str:
        """The text of ``ev``'s tokens that can be sent now; sets ``finish`` at the end."""
        if self.first_token is None and ev.token_ids:
            self.first_token = self.clock()
        final = ev.finish is not None
        if not self.stops.stops:
            self.count += len(ev.token_ids)
            self.finish = ev.finish
            return self.detok(ev.token_ids, final=final)
        parts = []
        for i, token in enumerate(ev.token_ids):  # a token at a time: count up to the stop
            self.count += 1
            parts.append(self.stops.feed(self.detok((token,),
                                                    final=final and i == len(ev.token_ids) - 1)))
            if self.stops.stopped:
                self.finish = "stop"
                return "".join(parts)
        if final:
            if not ev.token_ids:
                parts.append(self.stops.feed(self.detok((), final=True)))
            if not self.stops.stopped:
                parts.append(self.stops.flush())
            self.finish = "stop" if self.stops.stopped else ev.finish
        return "".join(parts)

    def log(self) -> None:
        """The access-log line: once per request that reached the engine."""
        if self._logged:
            return
        self._logged = True
        now, arrival = self.clock(), self.request.arrival_time
        ttft = "-" if self.first_token is None else f"{self.first_token - arrival:.3f} s"
        access_log.info("%s: prompt %d tokens, output %d tokens, TTFT %s, E2EL %.3f s, "
                        "finish %s", self.rid, self.request.prompt_len, self.count, ttft,
                        now - arrival, self.finish or "abort")


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _body(request: Request) -> bytes:
    """The request's body; a connection that ends before it is all in (the client left, or
    server.request_timeout_s passed) is one line in the log."""
    try:
        return await request.body()
    except ClientDisconnect:
        client = request.client
        log.warning("%s %s: the connection closed before the whole body arrived",
                    f"{client.host}:{client.port}" if client else "a client", request.url.path)
        raise APIError("the client disconnected", 499, "client_closed_request") from None


class Guard:
    """What every HTTP request passes before the app: its Host header (DNS rebinding), its API
    key, and its body's size (read no further than ``max_body_bytes``).

    The Host rule: an IP address, ``localhost`` and ``*.localhost`` (browsers resolve these to
    loopback themselves), ``server.host`` and the names in ``server.allowed_hosts`` ("*": any).
    DNS rebinding needs a name the attacker's DNS answers for, so an address is safe; any other
    name is refused. A request without Host (HTTP/1.0) is no browser's and passes.
    """

    def __init__(self, app: ASGIApp, settings: HTTPSettings) -> None:
        self.app, self.settings = app, settings
        names = {h.lower().rstrip(".") for h in settings.allowed_hosts}
        if not _is_address(settings.host):
            names.add(settings.host.lower().rstrip("."))
        self.any_host, self.hosts = "*" in names, frozenset(names)
        key = settings.api_key
        self.bearer = None if key is None else f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        try:
            self.check(scope, headers)
        except APIError as err:
            extra = {"www-authenticate": "Bearer"} if err.status == 401 else None
            await JSONResponse(err.body(), err.status, headers=extra)(scope, receive, send)
            return
        limit, seen = self.settings.max_body_bytes, 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # a chunked body, or one longer than its Content-Length said
                    raise _too_large(limit)
            return message

        await self.app(scope, counted, send)

    def check(self, scope: Scope, headers: Headers) -> None:
        host = headers.get("host")
        if host is not None and not self.any_host and not self.host_allowed(host):
            raise APIError(f"Host {host!r} is not allowed: add its name to server.allowed_hosts "
                           "(docs/serving.md)", param="host")
        if self.bearer is not None and scope["path"].startswith("/v1/"):
            got = headers.get("authorization", "").encode("latin-1")
            if not hmac.compare_digest(got, self.bearer):
                raise APIError("a valid API key is needed: Authorization: Bearer <server.api_key>",
                               401, "authentication_error")
        length, limit = headers.get("content-length", ""), self.settings.max_body_bytes
        if length.isdigit() and (len(length) > 18 or int(length) > limit):  # refused unread
            raise _too_large(limit)

    def host_allowed(self, host: str) -> bool:
        name = host[1:host.find("]")] if host.startswith("[") else host.rsplit(":", 1)[0]
        name = name.lower().rstrip(".")
        return (name in self.hosts or name == "localhost" or name.endswith(".localhost")
                or _is_address(name))


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


def _too_large(limit: int) -> APIError:
    return APIError(f"the request body exceeds {limit} bytes (server.max_body_bytes)", 413)

