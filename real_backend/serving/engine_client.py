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
import os
import queue
import socket
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from policies.request import Request
from policies.sampling_params import Logprob

METRICS_TIMEOUT_S = 10.0  # how long GET /metrics waits for the engine's text
SHUTTING_DOWN = "the server is shutting down"


@dataclass(frozen=True, slots=True)
class Event:
    """What a stream's queue receives, for each of its requests (``index``): ``accepted``
    first (or ``error``, the scheduler's refusal), then its new tokens per window, the last
    with ``finish`` ("stop": the model's stop token; "length": max_tokens; "abort": the server
    is shutting down). A stop sequence is found by the front end, in the text (app.py). Where
    the request asked for them, the tokens' logprobs come along (one per token), and the
    prompt logprobs its window computed ((first position, one per position))."""

    token_ids: tuple[int, ...] = ()
    finish: str | None = None
    error: str | None = None
    accepted: bool = False
    unavailable: bool = False  # the error is the server's state (failed, shutting down)
    index: int = 0  # which of the stream's requests
    logprobs: list[Logprob] | None = None
    prompt_logprobs: tuple[int, list[Logprob]] | None = None


@dataclass(slots=True, eq=False)
class Stream:
    """The requests of one HTTP request (its n choices) and the queue their events arrive
    on."""

    requests: tuple[Request, ...]
    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)

    @property
    def request(self) -> Request:
        return self.requests[0]


class EngineClient:
    """Submits requests and aborts to the engine process, and routes its events back."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.t0: float | None = None  # the engine clock's origin (perf_counter), once ready
        self.error: str | None = None  # set when the engine failed or went away
        # set when the policy stalled (it formed no batch for the requests it held, which
        # failed with this): the engine still runs, /health reports it from then on
        self.stalled: str | None = None
        self.on_fail: Callable[[], None] = lambda: None
        self._closing = False
        self._streams: dict[int, tuple[Stream, int]] = {}  # request id -> its stream, index
        self._metrics: dict[int, asyncio.Future[bytes]] = {}
        self._tokens = itertools.count()
        self._outbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="to-engine", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None

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
        self._loop = loop
        threading.Thread(target=self._receive_loop, name="from-engine", daemon=True).start()
        self._sender.start()

    def _send_loop(self) -> None:
        try:
            while (message := self._outbox.get()) is not None:
                self.conn.send(message)
        except OSError:  # the engine has gone; the receiver sees the pipe's end
            pass
        except BaseException:  # noqa: BLE001 (the thread's end: the server cannot go on)
            self._broken("the front end could not send to the engine")

    def _receive_loop(self) -> None:
        loop = self._loop
        try:
            while True:
                loop.call_soon_threadsafe(self._dispatch, self.conn.recv())
        except (EOFError, OSError):
            message = "the engine stopped"
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            return
        except BaseException:  # noqa: BLE001 (the thread's end: the server cannot go on)
            self._broken("the front end could not read the engine's messages")
            return
        try:
            loop.call_soon_threadsafe(self._fail, message)
        except RuntimeError:
            pass

    def _broken(self, message: str) -> None:
        """A pipe thread failed: say why, fail every request, and shut the pipe down, so that
        the engine sees its end (and closes) rather than waiting on a front end that no
        longer reads or sends. (Shut down, not closed: the other thread may be blocked on
        it, which a close would not wake.)"""
        traceback.print_exc()
        try:
            self._loop.call_soon_threadsafe(self._fail, message)
        except RuntimeError:
            pass
        try:
            with socket.socket(fileno=os.dup(self.conn.fileno())) as pipe:
                pipe.shutdown(socket.SHUT_RDWR)
        except OSError:
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

    def submit(self, *requests: Request) -> Stream:
        """Send ``requests`` to the scheduler, arrived now (from the event loop), in one
        message: the engine admits them together (the n choices of one HTTP request, which
        share the prompt's blocks through the prefix cache)."""
        if not self.accepting:
            raise RuntimeError(self.error or SHUTTING_DOWN)
        now = self.clock()
        stream = Stream(requests)
        for i, request in enumerate(requests):
            request.arrival_time = now
            self._streams[request.request_id] = (stream, i)
        self._outbox.put(("add", *requests))
        return stream

    def abort(self, request_id: int) -> None:
        if self._streams.pop(request_id, None) is not None:
            self._outbox.put(("abort", request_id))

    def finish(self, request_id: int) -> None:
        """The request's reply is complete (a stop sequence): the engine ends it as finished,
        not aborted, and frees its KV blocks."""
        if self._streams.pop(request_id, None) is not None:
            self._outbox.put(("stop", request_id))

    async def engine_metrics(self) -> bytes:
        """The engine's Prometheus text (empty once it is closing, has failed, or does not
        answer in time)."""
        if self.error is not None or self._closing:
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
            for rid, token_ids, finish, error, accepted, *logprobs in message[1]:
                got = streams.get(rid)
                if got is None:  # aborted here already
                    continue
                stream, index = got
                if finish or error:
                    del streams[rid]
                stream.queue.put_nowait(Event(token_ids, finish, error, accepted,
                                              error == SHUTTING_DOWN, index, *logprobs))
        elif kind == "metrics":
            future = self._metrics.get(message[1])
            if future is not None and not future.done():
                future.set_result(message[2])
        elif kind == "stalled":
            self.stalled = self.stalled or message[1]
        elif kind == "fail":
            self._fail(message[1])

    def _fail(self, message: str) -> None:
        """The engine failed or went away: every request still waiting gets the error."""
        first = self.error is None
        self.error = self.error or message
        for stream, index in self._streams.values():
            stream.queue.put_nowait(Event(error=message, unavailable=True, index=index))
        self._streams.clear()
        for future in self._metrics.values():
            if not future.done():
                future.set_result(b"")
        if first:
            self.on_fail()
