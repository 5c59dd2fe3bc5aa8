"""The front-end process: uvicorn serving the FastAPI app (real_backend/serving/app.py) over
the pipe to the engine process (experiments/serve.py starts it).

It runs in a process of its own, as vLLM's multiprocessing front end does, so that HTTP
parsing, tokenization, detokenization and SSE never hold the engine's interpreter lock: in
one process the engine thread's input preparation, which releases the lock at every torch
call, waited for it behind a busy front end (docs/validation/README.md, the server section).
"""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import uvicorn

from real_backend.sampling import SamplingParams
from real_backend.serving.engine_client import EngineClient


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str
    max_model_len: int
    vocab_size: int
    sampling: SamplingParams
    tokenizer: str | None  # model.tokenizer (None: the Llama-3 tokenizer)


def run_front_end(model: ServedModel, banner: str, conn: Connection,
                  sock: socket.socket) -> None:
    """The front-end process's main: wait for the engine loop, then serve on ``sock`` until
    the engine process sends SIGTERM (a clean shutdown: the engine aborts what is running,
    streams end with finish_reason "abort"), the engine fails, or it goes away."""
    from real_backend.serving.app import build_app
    from real_backend.serving.metrics import FrontEndMetrics
    from real_backend.serving.tokenizer import Tokenizer

    # SIGINT is ignored here, as inherited from the engine process (experiments/serve.py),
    # which passes a terminal's Ctrl-C on as SIGTERM
    client = EngineClient(conn)
    app = build_app(model, Tokenizer(model.tokenizer, model.vocab_size), client,
                    FrontEndMetrics())
    # Requests are taken once the engine loop runs: its clock, which stamps their arrival,
    # has started. Until then connections wait in the bound socket's backlog.
    if not client.wait_ready():
        sys.exit(1)
    server = _Uvicorn(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=10,
                                     lifespan="on"), client)
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
