"""What the simulator adds to SimPy's vocabulary: an event at an absolute time (``At``), and
``call_at`` for a callback then.

A process that computed the time it must wake at waits for ``At(env, t)``. A timeout of
``t - env.now`` wakes at ``env.now + (t - env.now)``, which can be a last bit away from ``t``
(for about one pair of times in fifty the sum falls on a tie and rounds to the even
neighbour), and then no delay lands on ``t`` exactly. So ``At`` is a SimPy event that SimPy schedules at ``t``
itself, in its own queue and by its own order (time, then priority, then scheduling order):
a process wakes at the time it computed whatever else shares the environment, a replica of a
cluster keeps the timeline it has alone, and a run's files are the same to the bit. That
needs SimPy's queue entry ``(time, priority, event id, event)``, which is why pyproject.toml
pins simpy's version and tests/test_sim_events.py checks the entry.
"""

from __future__ import annotations

from collections.abc import Callable
from heapq import heappush

import simpy
from simpy.events import NORMAL, Event


class At(Event):
    """An event that happens at time ``t`` (>= now), after the events already due then; its
    callbacks and the processes waiting for it run then (SimPy's ``Timeout`` at an absolute
    time)."""

    _ok = True  # (triggered as it is made, as a Timeout, with no value)
    _value = None

    def __init__(self, env: simpy.Environment, t: float) -> None:
        if t < env._now:
            raise ValueError(f"an event at {t} is in the past (now {env._now})")
        self.env = env
        self.callbacks = []
        heappush(env._queue, (t, NORMAL, next(env._eid), self))


def call_at(env: simpy.Environment, t: float, fn: Callable[[], object]) -> None:
    """Call ``fn()`` at time ``t`` (>= now), after what is already due then: a callback on an
    ``At`` event, where a process of its own would cost more than the work it does."""
    At(env, t).callbacks.append(lambda _: fn())

