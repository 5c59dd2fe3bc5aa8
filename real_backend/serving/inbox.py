"""The serving loop's online request source: a thread-safe inbox that the HTTP front end fills
and the engine loop drains once per iteration, and per-request output queues the engine thread
feeds through the front end's event loop.

The engine thread never waits on the front end: it takes what the inbox holds under a lock
held for a few list operations, and hands tokens over with ``loop.call_soon_threadsafe``,
which only appends a callback to the event loop's queue. The front end never touches the
scheduler: it submits requests and aborts, and reads its own queue.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from policies.batch import Batch
from policies.request import Request, RequestState
from policies.scheduler import Scheduler
from real_backend.serving.metrics import ServerMetrics


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
    """One request and its way back to the front end's event loop."""

    request: Request
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    sent: int = 0  # output tokens handed to the queue (engine thread only)


def hand_over(events: list[tuple[Stream, Event]]) -> None:
    """Put each event on its stream's queue, from the engine thread: one
    ``call_soon_threadsafe`` per event loop (a lock and a wake-up write each), not one per
    event, so a window's tokens for hundreds of requests cost the engine thread one call."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Event], Event]]] = {}
    for stream, event in events:
        by_loop.setdefault(stream.loop, []).append((stream.queue, event))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass


def _put_all(items: list[tuple[asyncio.Queue[Event], Event]]) -> None:
    for queue, event in items:
        queue.put_nowait(event)


class Inbox:
    """The serving loop's RequestSource online (real_backend/request_source.py).

    A request's arrival time is the engine clock's when it is submitted, so that its TTFT
    counts the wait until the engine next takes the inbox (up to a whole window); requests
    enter the scheduler at the top of a loop iteration. Aborts are applied there too, and so
    is a shutdown, which aborts every request left and lets the loop end once the window in
    flight is updated. ``ready`` is set once the loop runs: the clock has started, so
    requests may come (a submission stamped before the clock starts would be on the wrong
    clock).
    """

    def __init__(self, sched: Scheduler, metrics: ServerMetrics,
                 clock: Callable[[], float]) -> None:
        self.sched, self.metrics, self.clock = sched, metrics, clock
        self.ready = threading.Event()
        self._cond = threading.Condition()
        self._new: list[Stream] = []
        self._aborts: list[int] = []
        self._closing = False  # close() was called (front end's view)
        self._closed = False  # the engine has applied it
        self._streams: dict[int, Stream] = {}  # in the scheduler (engine thread only)
        self.error: str | None = None  # set when the engine loop failed

    # ---------------------------------------------------------------- the front end's side
    def submit(self, request: Request) -> Stream:
        """Queue ``request`` for the scheduler, arrived now (call from the event loop's
        thread; the engine clock is a perf_counter offset, safe to read from any thread)."""
        stream = Stream(request, asyncio.get_running_loop())
        with self._cond:
            if self._closing or self.error:
                raise RuntimeError("the server is shutting down")
            request.arrival_time = self.clock()
            self._new.append(stream)
            self._cond.notify()
        return stream

    def abort(self, request_id: int) -> None:
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def close(self) -> None:
        """Stop taking requests; those in the scheduler are aborted ("abort" on their queue)."""
        with self._cond:
            self._closing = True
            self._cond.notify()

    @property
    def accepting(self) -> bool:
        return not self._closing and self.error is None

    # ---------------------------------------------------------------- the engine's side
    @property
    def open(self) -> bool:
        return not self._closed

    def release(self, sched: Scheduler, now: float) -> None:
        if not self.ready.is_set():
            self.ready.set()
        with self._cond:
            new, self._new = self._new, []
            aborts, self._aborts = self._aborts, []
            closing = self._closing
        events = []
        for s in new:  # arrived at submit(), not now
            try:
                sched.add_request(s.request)
            except ValueError as err:  # the scheduler's own admission checks
                events.append((s, Event(error=str(err))))
                continue
            self._streams[s.request.request_id] = s
            events.append((s, Event(accepted=True)))
        hand_over(events)
        for rid in aborts:
            if self._streams.pop(rid, None) is not None and sched.abort(rid):
                self.metrics.aborted.inc()
        if closing and not self._closed:
            for rid in self._streams:
                if sched.abort(rid):
                    self.metrics.aborted.inc()
            hand_over([(s, Event(finish="abort")) for s in self._streams.values()])
            self._streams.clear()
            self._closed = True
        self.metrics.sample(sched)

    def wait(self, sched: Scheduler, clock: Callable[[], float]) -> None:
        """Nothing to run: block until the front end puts something in the inbox."""
        with self._cond:
            while not (self._new or self._aborts or self._closing):
                self._cond.wait()

    def delivered(self, batch: Batch, finished: list[Request]) -> None:
        """After ``update(batch)``: each request's new tokens to its queue, one event per
        window (a k-step window's tokens arrive as one burst, as they are known)."""
        streams = self._streams
        events = []
        try:
            for seq in batch.seqs:
                req = seq.request
                s = streams.get(req.request_id)
                if s is None or len(req.output_token_ids) == s.sent and not req.is_finished:
                    continue
                new = tuple(req.output_token_ids[s.sent:])
                s.sent += len(new)
                finish = None
                if req.state is RequestState.FINISHED:
                    stopped = (req.eos_token_id is not None and new
                               and new[-1] == req.eos_token_id)
                    finish = "stop" if stopped else "length"
                    del streams[req.request_id]
                events.append((s, Event(new, finish)))
                if finish:
                    self.metrics.request_done(req)
        finally:  # a finished stream is no longer in _streams: fail() could not reach it
            hand_over(events)
        self.metrics.window(batch.num_steps)
        self.metrics.sample(self.sched)

    def fail(self, message: str) -> None:
        """The engine loop died: every request still known gets the error."""
        with self._cond:
            self.error = message
            new, self._new = self._new, []
        hand_over([(s, Event(error=message)) for s in [*new, *self._streams.values()]])
        self._streams.clear()
