"""The benchmark client both backends serve: when each request is sent (its arrival time, held
back by vLLM benchmark_serving's ``--max-concurrency`` semaphore), and its progress bar.

This is the client's behaviour, not a scheduling decision: a policy sees a request only once
it has been sent. benchmark_serving (v0.6) creates each request's task at its arrival time, and
the task waits on ``asyncio.Semaphore(max_concurrency)`` before its request function starts
the clock (``st = time.perf_counter()``) and posts it. So a request due while
``max_concurrency`` requests are unfinished is sent when one of them finishes (waiters in
arrival order), and its TTFT and E2EL are measured from that send, not from when it was due.
``Client.send_due`` therefore sets each sent request's ``arrival_time`` to its send time, the
moment the server receives it; without a limit that is its due time, unchanged.

A later turn of a conversation (``Request.previous_turn``) is due ``think_time`` after its
previous turn's last token reached the client, and not before its own arrival time, as vLLM's
multi-turn benchmark sends a conversation's turns in turn.
"""

from __future__ import annotations

import heapq
import operator
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Protocol


class Request(Protocol):
    """What the client reads and sets of a request (policies/request.py's Request has it):
    named here, not imported, as common/ imports nothing above it."""

    request_id: int
    arrival_time: float
    previous_turn: int | None
    think_time: float

# The run's progress bar counts finished requests, without a rate: tqdm's "req/s" would read
# like the benchmark's request throughput, which it is not (wall-clock, and the simulator's
# wall clock is not its simulated one).
PROGRESS_BAR_FORMAT = ("{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} requests finished "
                       "[{elapsed}<{remaining}]")


class Client:
    """Sends requests in arrival order, at most ``max_concurrency`` unfinished (None: no limit).

    A backend calls ``send_due(now)`` to hand the due requests to its scheduler, and
    ``finished(times)`` with the time each finished request's last token reached the client
    (which frees its slot at that time); ``next_send_time()`` says when to look again.
    """

    def __init__(self, requests: Sequence[Request], max_concurrency: int | None = None) -> None:
        if max_concurrency is not None and (isinstance(max_concurrency, bool)
                                            or not isinstance(max_concurrency, int)
                                            or max_concurrency < 1):
            raise ValueError(f"workload.max_concurrency must be an integer >= 1 or null, "
                             f"got {max_concurrency!r}")
        self.max_concurrency = max_concurrency
        # later turns wait for their previous turn (by its request id), then for their due time
        self._followups: dict[int, Request] = {}
        for r in [r for r in requests if r.previous_turn is not None]:
            if r.previous_turn in self._followups:
                raise ValueError(f"requests {self._followups[r.previous_turn].request_id} and "
                                 f"{r.request_id} both follow request {r.previous_turn}")
            self._followups[r.previous_turn] = r
        missing = set(self._followups).difference(
            map(operator.attrgetter("request_id"), requests)) if self._followups else ()
        if missing:
            raise ValueError(f"request {self._followups[min(missing)].request_id} follows "
                             f"request {min(missing)}, which the workload does not have")
        self._due: list[tuple[float, int, Request]] = []  # (due time, id, request), a min-heap
        by_time = operator.attrgetter("arrival_time")
        self._unsent = deque(sorted((r for r in requests if r.previous_turn is None),
                                    key=by_time) if self._followups
                             else sorted(requests, key=by_time))
        # times at which a slot was freed and not yet taken (a min-heap); every slot is free
        # from the start
        self._free_at: list[float] = [float("-inf")] * (max_concurrency or 0)
        self.num_in_flight = 0

    @property
    def num_unsent(self) -> int:
        return len(self._unsent) + len(self._due) + len(self._followups)

    @property
    def has_followups(self) -> bool:
        """Whether some request waits for another's finish (a later turn of a conversation)."""
        return bool(self._followups) or bool(self._due)

    def _slot_free(self, now: float) -> bool:
        return self.max_concurrency is None or bool(self._free_at and self._free_at[0] <= now)

    def send_due(self, now: float) -> list[Request]:
        """The requests sent by ``now``, in arrival order: each one due by now, while a slot
        is free. A request held back by the limit gets the time its slot was freed as its
        ``arrival_time``."""
        sent = []
        unsent, due = self._unsent, self._due
        limited = self.max_concurrency is not None
        if not limited and not due:  # every slot free, no later turn due: the loop below, bare
            while unsent and unsent[0].arrival_time <= now:
                sent.append(unsent.popleft())
        while self._slot_free(now):
            if due and due[0][0] <= now and (not unsent or due[0][0] <= unsent[0].arrival_time):
                req = heapq.heappop(due)[2]
            elif unsent and unsent[0].arrival_time <= now:
                req = unsent.popleft()
            else:
                break
            if limited:
                req.arrival_time = max(req.arrival_time, heapq.heappop(self._free_at))
            sent.append(req)
        self.num_in_flight += len(sent)
        return sent

    def finished(self, requests: Sequence[Request], times: Iterable[float]) -> list[float]:
        """``requests`` finished, each one's last token delivered at the time in ``times`` (its
        slot is freed then); the times at which later turns they held back are now due."""
        if len(requests) > self.num_in_flight:
            raise RuntimeError(f"{len(requests)} requests finished but only {self.num_in_flight} "
                               "were sent and unfinished")
        self.num_in_flight -= len(requests)
        limited = self.max_concurrency is not None
        if not limited and not self._followups:
            return []
        followups = self._followups
        due: list[float] = []
        for r, t in zip(requests, times, strict=True):
            if limited:
                heapq.heappush(self._free_at, t)
            nxt = followups.pop(r.request_id, None) if followups else None
            if nxt is not None:
                nxt.arrival_time = max(nxt.arrival_time, t + nxt.think_time)
                heapq.heappush(self._due, (nxt.arrival_time, nxt.request_id, nxt))
                due.append(nxt.arrival_time)
        return due

    def next_send_time(self) -> float | None:
        """When the next request goes out if nothing finishes first: its due time, or the
        time a slot frees if that is later; None when none is left to send but later turns
        waiting on a finish, or every slot is held by an unfinished request (the next send
        waits for a finish)."""
        unsent, due = self._unsent, self._due
        if not unsent and not due:
            return None
        t = unsent[0].arrival_time if unsent else due[0][0]
        if due and due[0][0] < t:
            t = due[0][0]
        if self.max_concurrency is None:
            return t
        if not self._free_at:
            return None
        return max(t, self._free_at[0])
