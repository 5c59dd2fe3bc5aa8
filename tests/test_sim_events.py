"""The SimPy behaviour the simulator stands on (simulator/events.py), pinned: an event at an
absolute time wakes at that time exactly, where a timeout of the difference does not, and
simultaneous events run in the order they were scheduled, whatever made them. A SimPy release
that changed its queue's entry or its order would fail here before it changed any result."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import simpy

from simulator.events import At, call_at

ROOT = Path(__file__).resolve().parents[1]
# now + (t - now) lands a last bit off t (a tie rounded to the even neighbour), and no delay
# lands on t from now
NOW, T = 1.6646827560779576, 13.462270508774141


def test_an_event_at_a_time_wakes_at_it_where_a_timeout_does_not():
    assert NOW + (T - NOW) != T
    woke = {}

    def sleeper(env, name, make):
        yield env.timeout(NOW)
        yield make(env)
        woke[name] = env.now

    env = simpy.Environment()
    env.process(sleeper(env, "at", lambda env: At(env, T)))
    env.process(sleeper(env, "timeout", lambda env: env.timeout(T - env.now)))
    env.run()
    assert woke["at"] == T
    assert woke["timeout"] != T  # (what a port on timeouts alone would have given)


def test_simultaneous_events_run_in_the_order_they_were_scheduled():
    """At, a timeout, a succeeded event and a callback due at the same time run in scheduling
    order; a later-scheduled event at an earlier time runs first."""
    env = simpy.Environment()
    order = []

    def waiter(name, event):
        yield event
        order.append(name)

    def scheduler(env):
        yield env.timeout(1.0)
        signal = env.event()
        env.process(waiter("at", At(env, 3.0)))
        call_at(env, 3.0, lambda: order.append("call_at"))
        env.process(waiter("timeout", env.timeout(2.0)))
        env.process(waiter("signal", signal))
        yield At(env, 3.0)
        signal.succeed()  # due now, behind everything already due at 3.0
        order.append("scheduler")

    env.process(scheduler(env))
    env.run()
    assert order == ["at", "call_at", "timeout", "scheduler", "signal"]


def test_an_event_in_the_past_is_refused():
    env = simpy.Environment()
    env.run(until=3.0)
    with pytest.raises(ValueError, match=r"^an event at 2.5 is in the past \(now 3.0\)$"):
        call_at(env, 2.5, lambda: None)


def test_the_pinned_simpy_is_the_one_installed():
    """simulator/events.py writes SimPy's queue entries itself: the version it was checked
    against is the one pyproject.toml pins and the one that runs."""
    pins = re.findall(r'^\s*"(simpy\b[^"]*)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert pins == [f"simpy=={simpy.__version__}"], pins
