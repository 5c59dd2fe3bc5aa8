"""The serving loop's online request source: the engine process's end of the pipe to the
front-end process (real_backend/serving/engine_client.py holds the other end).

Messages are tuples. The front end sends ``("add", Request, ...)`` (the n choices of one HTTP
request, admitted together), ``("abort", id)``, ``("stop", id)`` (its reply reached a stop
sequence: ended as finished), ``("metrics", token)`` and ``("close",)``; the engine sends
``("ready", t0)`` once its loop runs (the engine clock's origin, a ``time.perf_counter``
reading, which is the same clock in every process of the host),
``("events", [(id, token_ids, finish, error, accepted[, logprobs, prompt_logprobs]), ...])``
once per loop iteration that has any (the logprobs where the request asked for them:
runner.WindowResult's), ``("metrics", token, text)``, ``("stalled", message)`` (the policy
formed no batch for the requests it held, which have failed: /health says so) and
``("fail", message)``.

The engine does not wait for the front end's messages: ``release()`` takes only those already
in the pipe. Its own leave as one message per loop iteration (a window's tokens for every
request), written to the pipe; the front end's receiver thread reads them at once, so the
write waits only if the front end stops reading. The front end never touches the
scheduler.
"""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from policies.batch import Batch
from policies.prefix_cache import token_segments
from policies.request import Request, RequestState
from policies.scheduler import Scheduler
from real_backend.engine import Clock
from real_backend.serving.engine_client import SHUTTING_DOWN
from real_backend.serving.metrics import EngineMetrics

if TYPE_CHECKING:
    from real_backend.runner import WindowResult

# an event: (request id, new token ids, finish reason or None, error or None, accepted), and
# where the request asked for them, (its tokens' logprobs, its prompt's: (position, logprobs))
EventTuple = tuple[Any, ...]


class Inbox:
    """The serving loop's RequestSource online (real_backend/request_source.py).

    A request's arrival time is stamped by the front end when it submits it, on the engine
    clock, so its TTFT counts the wait in the pipe until the engine next takes it (up to a
    whole window). Requests enter the scheduler at the top of a loop iteration; aborts are
    applied there too, in the order they were sent, and so is the close, which aborts every
    request left and lets the loop end once the window in flight is updated. A front end that
    has gone (the pipe's end closed) counts as a close.
    """

    def __init__(self, conn: Connection, sched: Scheduler, metrics: EngineMetrics,
                 clock: Clock) -> None:
        self.conn, self.sched, self.metrics, self.clock = conn, sched, metrics, clock
        self._ready = False  # "ready" sent
        self._closed = False
        self._gone = False  # the front end's end of the pipe is closed
        self._stalled = False  # the policy has stalled once ("stalled" sent)
        # requests in the scheduler that the front end waits on: output tokens sent so far
        self._sent: dict[int, int] = {}
        self._requests: dict[int, Request] = {}  # the same requests

    # ---------------------------------------------------------------- the pipe
    def _send(self, message: tuple[Any, ...]) -> None:
        if self._gone:
            return
        try:
            self.conn.send(message)
        except OSError:  # broken pipe: nobody is listening any more
            self._gone = True

    def _take(self) -> list[tuple[Any, ...]]:
        """The messages already in the pipe; a close at the end if the front end has gone."""
        messages = []
        if self._gone:
            return [("close",)]
        try:
            while self.conn.poll():
                messages.append(self.conn.recv())
        except (EOFError, OSError):
            self._gone = True
            messages.append(("close",))
        return messages

    def _emit(self, events: list[EventTuple]) -> None:
        if events:
            self._send(("events", events))

    # ---------------------------------------------------------------- RequestSource
    @property
    def open(self) -> bool:
        return not self._closed

    def release(self, sched: Scheduler, now: float) -> None:
        if not self._ready:
            self._ready = True
            self._send(("ready", self.clock.t0))
        events: list[EventTuple] = []
        for message in self._take():
            kind = message[0]
            if kind == "add":
                events += [self._add(sched, req) for req in message[1:]]
            elif kind == "abort":
                if self._sent.pop(message[1], None) is not None:
                    self._abort(sched, message[1])
                    del self._requests[message[1]]
            elif kind == "stop":  # ended like an abort (overlap: a window in flight wastes
                # its slots), counted as finished
                if self._sent.pop(message[1], None) is not None:
                    req = self._requests.pop(message[1])
                    if sched.abort(message[1]):
                        self.metrics.request_done(req)
            elif kind == "metrics":
                self.metrics.sample(sched)
                self._send(("metrics", message[1], self.metrics.text()))
            elif kind == "close" and not self._closed:
                for rid in self._sent:
                    self._abort(sched, rid)
                    events.append((rid, (), "abort", None, False))
                self._sent.clear()
                self._requests.clear()
                self._closed = True
        self._emit(events)
        self.metrics.sample(sched)

    def _abort(self, sched: Scheduler, rid: int) -> None:
        if sched.abort(rid):
            self.metrics.aborted.inc()

    def _add(self, sched: Scheduler, req: Request) -> EventTuple:
        rid = req.request_id
        if self._closed:
            return (rid, (), None, SHUTTING_DOWN, False)
        if sched.config.enable_prefix_caching and req.prompt_token_ids:
            # a served prompt's content is its token ids: equal runs of them share blocks
            req.prefix_segments = token_segments(req.prompt_token_ids)
        try:
            sched.add_request(req)
        except ValueError as err:  # the scheduler's own admission checks
            return (rid, (), None, str(err), False)
        self._sent[rid] = 0
        self._requests[rid] = req
        return (rid, (), None, None, True)

    def wait(self, sched: Scheduler, clock: Clock) -> None:
        """Nothing to run: block until the front end sends something (or goes). A scheduler
        that holds requests all the same has stalled (``Scheduler.stalled``): its requests
        would wait forever, so they fail now with its reason, and the server reports it."""
        stalled = sched.stalled()
        if stalled is not None:
            self._stall(sched, stalled)
        if not self._closed and not self._gone:
            self.conn.poll(None)

    def _stall(self, sched: Scheduler, message: str) -> None:
        """Fail every request the scheduler holds with ``message`` (their KV blocks freed); the
        first time, say it (the server's log, and /health from now on: sent before the
        requests' errors, so that a client who got one finds /health saying why)."""
        if not self._stalled:
            self._stalled = True
            print(f"error: {message}", file=sys.stderr, flush=True)
            self._send(("stalled", message))
        events: list[EventTuple] = []
        for rid in self._sent:
            self._abort(sched, rid)
            events.append((rid, (), None, message, False))
        self._sent.clear()
        self._requests.clear()
        self._emit(events)

    def delivered(self, batch: Batch, finished: list[Request],
                  out: WindowResult | None = None) -> None:
        """After ``update(batch)``: each request's new tokens, one event per window (a k-step
        window's tokens arrive as one burst, as they are known), with the logprobs of ``out``
        (the window's result) where the request asked for them, all in one message."""
        streamed = self._sent
        events: list[EventTuple] = []
        logprobs = out.logprobs if out is not None else None
        prompt = out.prompt_logprobs if out is not None else None
        try:
            for i, seq in enumerate(batch.seqs):
                req = seq.request
                rid = req.request_id
                sent = streamed.get(rid)
                span = prompt.get(i) if prompt else None
                if sent is None or (len(req.output_token_ids) == sent and not req.is_finished
                                    and span is None):
                    continue
                new = tuple(req.output_token_ids[sent:])
                streamed[rid] = sent + len(new)
                finish = None
                if req.state is RequestState.FINISHED:
                    stopped = (req.eos_token_id is not None and new
                               and new[-1] == req.eos_token_id)
                    finish = "stop" if stopped else "length"
                    del streamed[rid]
                    del self._requests[rid]
                lp = logprobs[i] if logprobs is not None and logprobs[i] else None
                if lp is not None or span is not None:  # the tokens' first: wasted slots' go
                    events.append((rid, new, finish, None, False, lp and lp[:len(new)], span))
                else:
                    events.append((rid, new, finish, None, False))
                if finish:
                    self.metrics.request_done(req)
        finally:  # a finished request has left _sent: fail() could not reach it
            self._emit(events)
        self.metrics.window(batch.num_steps)
        self.metrics.sample(self.sched)

    def fail(self, message: str) -> None:
        """The engine loop died: the front end fails every request it waits on, and stops."""
        self._sent.clear()
        self._requests.clear()
        self._send(("fail", message))
