"""The simulator's event heap: callbacks at absolute times, processes as generators, signals
and FIFO stages; simpy's ordering (time, then scheduling order) without its machinery.

A process is a generator that yields either a time (resume at that absolute time) or a
``Signal`` (resume once it fires). Waking at an absolute time, not after a delay, means a
process resumes at exactly the time it computed: the same whatever else shares the heap, so a
replica of a cluster keeps the timeline it has alone.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Generator
from types import GeneratorType
from typing import Any

Process = Generator[Any, None, None]


class EventLoop:
    __slots__ = ("now", "_heap", "_seq")

    def __init__(self) -> None:
        self.now: float = 0  # an int until the first event, as simpy's (a t=0 run's files say 0)
        self._heap: list[tuple[float, int, Callable[[], None] | Process]] = []
        self._seq = 0

    def at(self, t: float, fn: Callable[[], None] | Process) -> None:
        """Call ``fn`` at time ``t`` (>= now), after whatever is already due then (a process:
        resume it then)."""
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn))

    def process(self, gen: Process) -> None:
        """Start ``gen`` now (after what is already due now)."""
        self.at(self.now, gen)

    def _step(self, gen: Process) -> None:
        try:
            what = next(gen)
        except StopIteration:
            return
        if what.__class__ is float or what.__class__ is int:
            self.at(what, gen)
        else:
            what.waiter = gen

    def run(self) -> None:
        heap, pop, step = self._heap, heapq.heappop, self._step
        while heap:
            t, _, fn = pop(heap)
            self.now = t
            if fn.__class__ is GeneratorType:  # a process waiting for this time
                step(fn)
            else:
                fn()


class Signal:
    """A one-shot event a process waits on (it yields it): ``fire()`` queues its resumption
    now, behind what is already due now, as a simpy event's succeed() does; a signal fired
    before its process yields it resumes that process at the fire's place in the queue."""

    __slots__ = ("loop", "waiter")

    def __init__(self, loop: EventLoop) -> None:
        self.loop = loop
        self.waiter: Process | None = None

    def fire(self) -> None:
        self.loop.at(self.loop.now, self._resume)

    def _resume(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None:
            self.loop._step(waiter)


class Stage:
    """A FIFO server of capacity one (a pipeline stage): ``request()`` is a Signal that fires
    when the stage is this process's; ``release()`` hands it to the next in line."""

    __slots__ = ("loop", "busy", "queue")

    def __init__(self, loop: EventLoop) -> None:
        self.loop = loop
        self.busy = False
        self.queue: deque[Signal] = deque()

    def request(self) -> Signal:
        granted = Signal(self.loop)
        if self.busy:
            self.queue.append(granted)
        else:
            self.busy = True
            granted.fire()
        return granted

    def release(self) -> None:
        if self.queue:
            self.queue.popleft().fire()
        else:
            self.busy = False
