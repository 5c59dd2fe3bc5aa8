"""The front-end process's end of the pipe to the engine process (real_backend/serving/inbox.py
holds the other end, and says what the messages are).

The front end's event loop never blocks on the pipe: messages to the engine go through a queue
to a sender thread (the engine drains the pipe only at the top of each loop iteration, so a
burst of requests can fill it), and a receiver thread reads the engine's messages and hands each
to the event loop (``call_soon_threadsafe``), which puts each request's events on its own
``asyncio.Queue``. (The pipe stays a blocking socket read by a thread: an event loop that
watched it would make it non-blocking, and a message longer than the socket's buffer would
then arrive in parts.)
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from policies.request import Request

METRICS_TIMEOUT_S = 10.0  # how long GET /metrics waits for the engine's text


@dataclass(frozen=True, slots=True)
class Event:
    """What one request's queue receives: ``accepted`` first (or ``error``, the scheduler's
    refusal), then its new tokens per window, the last with ``finish`` ("stop": the model's
    stop token; "length": max_tokens; "abort": the server is shutting down)."""

    token_ids: tuple[int, ...] = ()
    finish: str | None = None
    error: str | None = None
    accepted: bool = False


@dataclass(slots=True, eq=False)
class Stream:
    """One request and the queue its events arrive on."""

    request: Request
    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)


class EngineClient:
    """Submits requests and aborts to the engine process, and routes its events back."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.t0: float | None = None  # the engine clock's origin (perf_counter), once ready
        self.error: str | None = None  # set when the engine failed or went away
        self.on_fail: Callable[[], None] = lambda: None
        self._closing = False
        self._streams: dict[int, Stream] = {}
        self._metrics: dict[int, asyncio.Future[bytes]] = {}
        self._tokens = itertools.count()
        self._outbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="to-engine", daemon=True)
        self._receiver: threading.Thread | None = None

    # ---------------------------------------------------------------- start and stop
    def wait_ready(self) -> bool:
        """Block until the engine loop runs (its clock has started, so arrival times can be
        stamped on it); False if the engine went away first."""
        try:
            while True:
                message = self.conn.recv()
                if message[0] == "ready":
                    self.t0 = message[1]
                    return True
                if message[0] == "fail":
                    self.error = message[1]
                    return False
        except (EOFError, OSError):
            self.error = "the engine stopped"
            return False

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start sending to the engine, and handing its messages to ``loop`` (once it runs)."""
        self._receiver = threading.Thread(target=self._receive_loop, args=(loop,),
                                          name="from-engine", daemon=True)
        self._receiver.start()
        self._sender.start()

    def _send_loop(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self.conn.send(message)
            except OSError:  # the engine has gone; the receiver sees the pipe's end
                return

    def _receive_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            while True:
                loop.call_soon_threadsafe(self._dispatch, self.conn.recv())
        except (EOFError, OSError):
            pass
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            return
        try:
            loop.call_soon_threadsafe(self._fail, "the engine stopped")
        except RuntimeError:
            pass

    def close(self) -> None:
        """Stop taking requests; the engine aborts those it has ("abort" on their queues)."""
        if not self._closing:
            self._closing = True
            self._outbox.put(("close",))

    def stop_sending(self) -> None:
        self._outbox.put(None)

    @property
    def accepting(self) -> bool:
        return not self._closing and self.error is None

    # ---------------------------------------------------------------- requests
    def clock(self) -> float:
        """The engine clock now."""
        return time.perf_counter() - self.t0

    def submit(self, request: Request) -> Stream:
        """Send ``request`` to the scheduler, arrived now (from the event loop)."""
        if not self.accepting:
            raise RuntimeError(self.error or "the server is shutting down")
        request.arrival_time = self.clock()
        stream = Stream(request)
        self._streams[request.request_id] = stream
        self._outbox.put(("add", request))
        return stream

    def abort(self, request_id: int) -> None:
        if self._streams.pop(request_id, None) is not None:
            self._outbox.put(("abort", request_id))

    async def engine_metrics(self) -> bytes:
        """The engine's Prometheus text (empty when it does not answer in time)."""
        if self.error is not None:
            return b""
        token = next(self._tokens)
        future = asyncio.get_running_loop().create_future()
        self._metrics[token] = future
        self._outbox.put(("metrics", token))
        try:
            return await asyncio.wait_for(future, METRICS_TIMEOUT_S)
        except TimeoutError:
            return b""
        finally:
            self._metrics.pop(token, None)

    # ---------------------------------------------------------------- from the engine
    def _dispatch(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "events":
            streams = self._streams
            for rid, token_ids, finish, error, accepted in message[1]:
                stream = streams.get(rid)
                if stream is None:  # aborted here already
                    continue
                if finish or error:
                    del streams[rid]
                stream.queue.put_nowait(Event(token_ids, finish, error, accepted))
        elif kind == "metrics":
            future = self._metrics.get(message[1])
            if future is not None and not future.done():
                future.set_result(message[2])
        elif kind == "fail":
            self._fail(message[1])

    def _fail(self, message: str) -> None:
        """The engine failed or went away: every request still waiting gets the error."""
        first = self.error is None
        self.error = self.error or message
        for stream in self._streams.values():
            stream.queue.put_nowait(Event(error=message))
        self._streams.clear()
        for future in self._metrics.values():
            if not future.done():
                future.set_result(b"")
        if first:
            self.on_fail()
