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
from dataclasses import dataclass
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
    Logprob,
    TokenText,
    chat_logprobs,
    choice,
    completion_body,
    completion_logprobs,
    parse,
    usage,
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
    show = TokenText(tokenizer.token_text, tokenizer.token_bytes)  # tokens in logprobs
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
        echo = None
        if req.echo:  # the prompt as sent; token ids as their text (vLLM's)
            echo = prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)
        max_tokens = 1 if req.prompt_only else req.max_tokens
        return await _generate(request, req, prompt_ids, max_tokens, chat=False, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse(ChatCompletionRequest, await _body(request))
        prompt_ids = tokenizer.encode_chat(req.turns())
        return await _generate(request, req, prompt_ids, req.output_limit, chat=True)

    async def _generate(http: Request, req: Any, prompt_ids: list[int], max_tokens: int | None,
                        chat: bool, echo: str | None = None) -> Response:
        """Serve ``req``: its n choices as n engine requests sharing the prompt, each with its
        own reply (text, stop sequences, logprobs); streamed, or one response."""
        if req.model is not None and req.model != model.name:
            raise APIError(f"model {req.model!r} is not served here; this server serves "
                           f"{model.name!r}", param="model")
        sampling = [req.sampling(model.sampling, i) for i in range(req.n)]
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
        engine_reqs = [EngineRequest(next(ids), 0.0, n, max_tokens, prompt_ids,
                                     eos_token_id=stop, sampling=s) for s in sampling]
        metrics.received.inc()
        try:
            stream = engine.submit(*engine_reqs)
        except RuntimeError as err:
            raise APIError(str(err), status=503, kind="service_unavailable") from None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{engine_reqs[0].request_id}"
        out = Output(model.name, rid, chat, req.num_logprobs, show, prompt_ids, echo,
                     req.prompt_only)
        replies = [Reply(rid if req.n == 1 else f"{rid}[{i}]", r, i,
                         tokenizer.detokenizer(stop), StopStrings(req.stop_strings()),
                         engine.clock) for i, r in enumerate(engine_reqs)]
        done = False
        watcher = asyncio.create_task(_watch(http, stream))
        try:
            early = await _accepted(stream, replies)
            if req.stream:
                done = True  # the stream's generator owns the requests (and the watcher) now
                return StreamingResponse(_sse(stream, watcher, req, replies, out, early),
                                         media_type="text/event-stream")
            try:
                await _collect(stream, replies, early)
            finally:
                watcher.cancel()
            done = True
            for reply in replies:
                reply.log()
            body = out.body([out.choice(r, r.text, r.tokens, chunk=False) for r in replies],
                            usage(n, sum(r.count for r in replies)), chunk=False)
            return JSONResponse(body)
        finally:
            if not done:  # refused, failed, the client gone, or the handler cancelled
                watcher.cancel()
                _abort(stream)
                for reply in replies:
                    reply.log()

    def _abort(stream: Stream) -> None:
        for request in stream.requests:
            engine.abort(request.request_id)

    async def _accepted(stream: Stream, replies: list[Reply]) -> list[Event]:
        """Wait until the engine has taken every request of ``stream`` (the events of those
        taken meanwhile are returned, in order); its refusal of one is the reply's error."""
        waiting, early = len(replies), []
        while waiting:
            ev = await stream.queue.get()
            if ev.error:  # the scheduler's refusal, or the server's state
                for reply in replies:
                    reply.finish = "error"
                raise (APIError(ev.error, 503, "service_unavailable") if ev.unavailable
                       else APIError(ev.error))
            if ev.accepted:
                waiting -= 1
            else:
                early.append(ev)
        return early

    async def _events(stream: Stream, replies: list[Reply], early: list[Event]
                      ) -> AsyncIterator[Event]:
        """The stream's events (``early`` first) until every reply has finished; a reply the
        engine failed, or whose client left, ends them all (GONE's or the error's event is
        the last)."""
        left = sum(1 for r in replies if not r.finish)
        queued = iter(early)
        while left:
            ev = next(queued, None) or await stream.queue.get()
            if ev.error:
                status = "disconnected" if ev.error is GONE else "error"
                for reply in replies:
                    reply.finish = reply.finish or status
                yield ev
                return
            reply = replies[ev.index]
            if reply.finish:  # a stop sequence ended it here; the engine's last events
                continue
            yield ev
            if reply.finish:
                left -= 1

    async def _watch(http: Request, stream: Stream) -> None:
        """The client's hang-up, seen as it happens (not at the next write): the requests are
        aborted, and their reader told to stop."""
        while (await http.receive())["type"] != "http.disconnect":
            pass
        _abort(stream)
        stream.queue.put_nowait(Event(error=GONE))

    def _take(reply: Reply, ev: Event) -> tuple[str, list[tuple[int, Logprob | None]]]:
        """``ev``'s text for the client, and its tokens counted with their logprobs; a stop
        sequence found in it ends the request in the engine too (its KV blocks freed at the
        engine's next iteration)."""
        text, tokens = reply.take(ev)
        if reply.finish == "stop" and ev.finish is None:
            engine.finish(reply.request.request_id)
        return text, tokens

    async def _collect(stream: Stream, replies: list[Reply], early: list[Event]) -> None:
        async for ev in _events(stream, replies, early):
            if ev.error is GONE:
                raise APIError("the client disconnected", 499, "client_closed_request")
            if ev.error:
                raise APIError(ev.error, 500, "server_error")
            reply = replies[ev.index]
            text, tokens = _take(reply, ev)
            reply.text += text
            reply.tokens += tokens

    async def _sse(stream: Stream, watcher: asyncio.Task, req: Any, replies: list[Reply],
                   out: Output, early: list[Event]) -> AsyncIterator[str]:
        n = stream.request.prompt_len
        finished = False
        try:
            async for ev in _events(stream, replies, early):
                if ev.error is GONE:  # aborted already; nobody to write to
                    finished = True
                    return
                if ev.error:  # the engine failed mid-stream: OpenAI's error object, then stop
                    yield _data(APIError(ev.error, 500, "server_error").body())
                    finished = True
                    return
                reply = replies[ev.index]
                text, tokens = _take(reply, ev)
                # a chunk for text, the end, a choice's first tokens or tokens with logprobs;
                # not for an event of prompt logprobs alone (kept for echo)
                if not (text or reply.finish or tokens and (
                        not reply.sent or out.num_logprobs is not None)):
                    continue
                if ev.token_ids:
                    metrics.sse_chunks.inc()
                use = usage(n, reply.count) if req.continuous_usage else None
                yield _data(out.body([out.choice(reply, text, tokens, chunk=True)], use,
                                     chunk=True))
            if req.include_usage:
                yield _data(out.usage_chunk(usage(n, sum(r.count for r in replies))))
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            watcher.cancel()
            if not finished:  # the generator was closed early (a write to a gone client)
                _abort(stream)
                for reply in replies:
                    reply.finish = reply.finish or "disconnected"
            for reply in replies:
                reply.log()

    return app


# what a watcher puts on a request's queue when its client has hung up
GONE = "the client disconnected"


@dataclass(frozen=True, slots=True)
class Output:
    """How one HTTP request's choices are written: its endpoint, the logprobs it asked for,
    and (completions' echo) the prompt before each choice's first text."""

    model: str
    rid: str
    chat: bool
    num_logprobs: int | None  # top logprobs per token; None: no logprobs
    show: TokenText
    prompt_ids: list[int]
    echo: str | None = None
    prompt_only: bool = False  # echo with max_tokens 0: the reply's token is not shown

    def choice(self, reply: Reply, text: str, tokens: list[tuple[int, Logprob | None]],
               chunk: bool) -> dict[str, Any]:
        """Reply ``reply``'s ``text`` and ``tokens`` as a choice (of a response, or of an SSE
        chunk); echo puts the prompt, and its logprobs, before its first."""
        first = not reply.sent
        reply.sent = True
        if self.prompt_only:
            text, tokens = "", []
        if self.echo is not None and first:
            text = self.echo + text
            given = reply.prompt_logprobs
            tokens = [(t, given.get(p)) for p, t in enumerate(self.prompt_ids)] + tokens
        logprobs = None
        if self.num_logprobs is not None:
            if self.chat:
                logprobs = chat_logprobs(tokens, self.num_logprobs, self.show)
            else:
                logprobs = completion_logprobs(tokens, self.num_logprobs, self.show,
                                               reply.offset)
        reply.offset += len(text)
        return choice(self.chat, chunk, reply.index, text, reply.finish, logprobs, first)

    def body(self, choices: list[dict[str, Any]], use: dict[str, int] | None, chunk: bool
             ) -> dict[str, Any]:
        return completion_body(self.rid, self.model, self.chat, choices, use, chunk=chunk)

    def usage_chunk(self, use: dict[str, int]) -> dict[str, Any]:
        """The last chunk of a stream with ``stream_options.include_usage``: no choices."""
        return self.body([], use, chunk=True)


class Reply:
    """One choice's reply as its tokens arrive: the text (detokenized, cut before a stop
    sequence), the tokens counted, the finish reason, the prompt's logprobs (echo), and its
    access-log line."""

    def __init__(self, rid: str, request: EngineRequest, index: int, detok: Detokenizer,
                 stops: StopStrings, clock: Callable[[], float]) -> None:
        self.rid, self.request, self.index, self.detok, self.stops, self.clock = (
            rid, request, index, detok, stops, clock)
        self.count = 0  # output tokens (up to the one that completed a stop sequence)
        self.finish: str | None = None
        self.first_token: float | None = None  # on the engine clock
        self.prompt_logprobs: dict[int, Logprob] = {}  # prompt position -> its logprobs
        self.sent = False  # a choice of it written (a chat stream's role, echo's prompt)
        self.offset = 0  # the text written so far (completions' logprobs' text_offset)
        self.text = ""  # a response's whole text and tokens, not streamed
        self.tokens: list[tuple[int, Logprob | None]] = []
        self._logged = False

    def take(self, ev: Event) -> tuple[str, list[tuple[int, Logprob | None]]]:
        """The text of ``ev``'s tokens that can be sent now, and those tokens with their
        logprobs (up to the one that completed a stop sequence); sets ``finish`` at the end."""
        if ev.prompt_logprobs is not None:  # the first computation of a position stays
            first, entries = ev.prompt_logprobs
            for pos, entry in enumerate(entries, first):
                self.prompt_logprobs.setdefault(pos, entry)
        before = self.count
        text = self._text(ev)
        used = ev.token_ids[:self.count - before]
        logprobs = ev.logprobs[:len(used)] if ev.logprobs is not None else [None] * len(used)
        return text, list(zip(used, logprobs, strict=True))

    def _text(self, ev: Event) -> str:
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

