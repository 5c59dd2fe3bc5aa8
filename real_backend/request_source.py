"""Where the serving loop's requests come from: the benchmark client's arrivals in an offline
run (common.client), or the HTTP server's inbox (real_backend/serving/inbox.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from tqdm import tqdm

from common.client import Client
from policies.batch import Batch
from policies.request import Request
from policies.scheduler import Scheduler

if TYPE_CHECKING:
    from real_backend.runner import WindowResult


class RequestSource(Protocol):
    """What the loop asks at the top of each iteration, when it has nothing to run, and after
    each ``update()``."""

    @property
    def open(self) -> bool:
        """More requests may still come (the loop ends when not, and nothing is unfinished)."""

    def release(self, sched: Scheduler, now: float) -> None:
        """Hand the scheduler what is due by ``now`` (new requests; online, aborts too)."""

    def wait(self, sched: Scheduler, clock: Callable[[], float]) -> None:
        """The scheduler formed no window: block until something may be due."""

    def delivered(self, batch: Batch, finished: list[Request],
                  out: WindowResult | None = None) -> None:
        """``update(batch)`` is done: its tokens are known, ``finished`` are done; ``out``
        what the window gave (the logprobs its requests asked for)."""


class ClientSource:
    """An offline run's requests, sent by the benchmark client (arrival times, concurrency
    limit), with a progress bar of finished requests."""

    def __init__(self, client: Client, bar: tqdm) -> None:
        self.client, self.bar = client, bar

    @property
    def open(self) -> bool:
        return bool(self.client.num_unsent)

    def release(self, sched: Scheduler, now: float) -> None:
        for req in self.client.send_due(now):
            sched.add_request(req)

    def wait(self, sched: Scheduler, clock: Callable[[], float]) -> None:
        t = self.client.next_send_time()
        if t is None:  # nothing left to send, or every slot held by a request the scheduler lost
            stalled = sched.stalled()
            if stalled:  # the policy's doing (a user's, as a rule): the run's one-line error
                raise ValueError(stalled)
            raise RuntimeError("the scheduler holds no request and the client's "
                               f"{self.client.num_unsent} unsent ones are never due")
        time.sleep(max(0.0, t - clock()))

    def delivered(self, batch: Batch, finished: list[Request],
                  out: WindowResult | None = None) -> None:
        # the client learns of each finished request at its last token's delivery time
        self.client.finished(finished, [r.finish_time for r in finished])
        self.bar.update(len(finished))
