"""The front-end process: uvicorn serving the FastAPI app (real_backend/serving/app.py) over
the pipe to the engine process (experiments/serve.py starts it).

It runs in a process of its own, as vLLM's multiprocessing front end does, so that HTTP
parsing, tokenization, detokenization and SSE never hold the engine's interpreter lock: in
one process the engine thread's input preparation, which releases the lock at every torch
call, waited for it behind a busy front end (docs/validation/README.md, the server section).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import signal
import socket
import sys
from collections.abc import Iterator
from http import HTTPStatus
from multiprocessing.connection import Connection
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from real_backend.serving.app import build_app
from real_backend.serving.engine_client import EngineClient
from real_backend.serving.settings import HTTPSettings, ServedModel  # noqa: F401  (re-exported)

FDS_SPARE = 256  # open files beyond the connections: the pipe, logs, libraries


def error_response(status: int, message: str, kind: str) -> bytes:
    """A whole HTTP/1.1 reply carrying OpenAI's error object, for the protocol to write where
    no app runs; the connection closes after it."""
    from real_backend.serving.protocol import APIError

    body = json.dumps(APIError(message, status, kind).body()).encode()
    return (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


def guarded_protocol(settings: HTTPSettings) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools, else h11) with the two limits uvicorn lacks.

    - A request must arrive whole (headers and body) within ``request_timeout_s`` of its
      first byte (of the connection, for the first): uvicorn times out idle keep-alive
      connections only, so a client that sends half a request held its socket forever.
      Past it: 408 if no reply has begun, and the connection closes.
    - At most ``max_connections`` connections: one more gets 503 and is closed at once
      (uvicorn's ``limit_concurrency`` keeps it open until its headers come, so half-sent
      requests could still take every file descriptor).
    Its own replies (these, and a request that is not HTTP) are OpenAI's error JSON.
    """
    timeout, cap = settings.request_timeout_s, settings.max_connections

    class GuardedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _timer: asyncio.TimerHandle | None = None
        _armed_cycle: Any = None  # the request cycle when the timer was armed

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > cap:
                transport.write(error_response(
                    503, f"the server holds {cap} connections (server.max_connections)",
                    "service_unavailable"))
                transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._timer is None and (self.cycle is None or not self.cycle.more_body):
                self._arm()  # the first bytes of the connection's next request
            super().data_received(data)
            cycle = self.cycle
            if (self._timer is not None and cycle is not None and cycle is not self._armed_cycle
                    and not cycle.more_body):
                self._disarm()  # the request is in whole

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            self.transport.write(error_response(400, msg, "invalid_request_error"))
            self.transport.close()

        def _arm(self) -> None:
            self._armed_cycle = self.cycle
            self._timer = self.loop.call_later(timeout, self._expire)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expire(self) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if cycle is None or cycle is self._armed_cycle or not cycle.response_started:
                self.transport.write(error_response(
                    408, f"the request did not arrive whole within {timeout:g} s "
                    "(server.request_timeout_s)", "invalid_request_error"))
            self.transport.close()

    return GuardedHTTPProtocol


def uvicorn_config(app: Any, settings: HTTPSettings) -> uvicorn.Config:
    """uvicorn's settings for the app: the guarded protocol, the keep-alive timeout."""
    return uvicorn.Config(app, http=guarded_protocol(settings), log_level="warning",
                          timeout_keep_alive=settings.keep_alive_timeout_s,
                          timeout_graceful_shutdown=10, lifespan="on")


def raise_open_files_limit(settings: HTTPSettings) -> None:
    """Let the process open a file per connection and some (as vLLM raises its limit): a
    soft limit of 1,024, common, would run out before ``max_connections``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = settings.max_connections + FDS_SPARE
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < need:
            print(f"warning: {new} open files at most (ulimit -Hn): fewer connections than "
                  f"server.max_connections={settings.max_connections} may be held",
                  file=sys.stderr, flush=True)


def run_front_end(model: ServedModel, settings: HTTPSettings, banner: str, conn: Connection,
                  sock: socket.socket) -> None:
    """The front-end process's main: wait for the engine loop, then serve on ``sock`` until
    the engine process sends SIGTERM (a clean shutdown: the engine aborts what is running,
    streams end with finish_reason "abort"), the engine fails, or it goes away."""
    from real_backend.serving.metrics import FrontEndMetrics
    from real_backend.serving.tokenizer import Tokenizer

    # SIGINT is ignored here, as inherited from the engine process (experiments/serve.py),
    # which passes a terminal's Ctrl-C on as SIGTERM
    access = logging.getLogger("schedlab.access")
    access.propagate = False
    if settings.access_log:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        access.addHandler(handler)
        access.setLevel(logging.INFO)
    else:
        access.disabled = True
    client = EngineClient(conn)
    app = build_app(model, Tokenizer(model.tokenizer, model.vocab_size), client,
                    FrontEndMetrics(), settings)
    raise_open_files_limit(settings)
    # Requests are taken once the engine loop runs: its clock, which stamps their arrival,
    # has started. Until then connections wait in the bound socket's backlog.
    if not client.wait_ready():
        sys.exit(1)
    server = _Uvicorn(uvicorn_config(app, settings), client)
    client.on_fail = server.stop
    print(f"serving {banner}", flush=True)
    server.run(sockets=[sock])
    client.stop_sending()


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, stopped by SIGTERM (the engine is told to close first, so requests in
    flight end with finish_reason "abort") or when the engine fails. (uvicorn itself would
    raise the signal again once stopped, killing the process with it.)"""

    def __init__(self, config: uvicorn.Config, client: EngineClient) -> None:
        super().__init__(config)
        self.client = client

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        old = signal.signal(signal.SIGTERM, self.handle_exit)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, old)

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.client.close()
        super().handle_exit(sig, frame)

    def stop(self) -> None:
        self.should_exit = True
