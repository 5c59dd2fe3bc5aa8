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
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from policies.request import Request

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
        self._unsent = deque(sorted(requests, key=lambda r: r.arrival_time))
        # times at which a slot was freed and not yet taken (a min-heap); every slot is free
        # from the start
        self._free_at: list[float] = [float("-inf")] * (max_concurrency or 0)
        self.num_in_flight = 0

    @property
    def num_unsent(self) -> int:
        return len(self._unsent)

    def _slot_free(self, now: float) -> bool:
        return self.max_concurrency is None or bool(self._free_at and self._free_at[0] <= now)

    def send_due(self, now: float) -> list[Request]:
        """The requests sent by ``now``, in arrival order: each one due by now, while a slot
        is free. A request held back by the limit gets the time its slot was freed as its
        ``arrival_time``."""
        sent = []
        unsent = self._unsent
        while unsent and unsent[0].arrival_time <= now and self._slot_free(now):
            req = unsent.popleft()
            if self.max_concurrency is not None:
                req.arrival_time = max(req.arrival_time, heapq.heappop(self._free_at))
            sent.append(req)
        self.num_in_flight += len(sent)
        return sent

    def finished(self, times: Iterable[float]) -> None:
        """Requests finished, each one's last token delivered at the given time."""
        n = 0
        for t in times:
            n += 1
            if self.max_concurrency is not None:
                heapq.heappush(self._free_at, t)
        if n > self.num_in_flight:
            raise RuntimeError(f"{n} requests finished but only {self.num_in_flight} were sent "
                               "and unfinished")
        self.num_in_flight -= n

    def next_send_time(self) -> float | None:
        """When the next request goes out if nothing finishes first: its due time, or the
        time a slot frees if that is later; None when none is left, or every slot is held by
        an unfinished request (the next send waits for a finish)."""
        if not self._unsent:
            return None
        if self.max_concurrency is None:
            return self._unsent[0].arrival_time
        if not self._free_at:
            return None
        return max(self._unsent[0].arrival_time, self._free_at[0])
