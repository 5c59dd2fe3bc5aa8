"""A user's own SimPy processes beside a simulation's (``backend.processes``, or ``simulate``'s
``processes``): a load that changes, a replica that fails and comes back, a monitor, without
editing the simulator (docs/simulator.md).

Each is a function ``fn(env, sim)`` that returns a generator, started as a SimPy process on the
simulation's environment at time 0, after the simulation's own processes; ``sim`` is the
``Simulation`` below. The run ends when the simulation's own processes have, whatever a user's
process still waits for (a monitor may loop for ever). A process that only reads leaves every
result as it is: SimPy runs simultaneous events in the order they were scheduled, and it
schedules none of the simulation's.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from types import GeneratorType
from typing import Any

import simpy

from common.client import Client
from policies.base import import_user_module
from policies.request import Request
from simulator.replica_state import ReplicaSim

SETTING = "backend.processes"

# fn(env, sim): a generator, run as a SimPy process
UserProcess = Callable[[simpy.Environment, "Simulation"], Generator[Any, Any, Any]]


@dataclass(frozen=True, slots=True, eq=False)
class Simulation:
    """What a user's process is given of a simulation in progress.

    ``env``: the simulation's ``simpy.Environment`` (``env.now`` is the simulated time).
    ``replicas``: each replica's state (``ReplicaSim``: its ``schedulers``, the ``load`` a router
    sees, ``stall(until)`` to hold its engine thread). ``client``: the benchmark client
    (``common.client.Client``: what is sent, in flight and waiting). ``requests``: the run's
    requests, in the order given.
    """

    env: simpy.Environment
    replicas: list[ReplicaSim]
    client: Client
    requests: list[Request]


def user_processes(processes: Sequence[UserProcess | str] | None) -> list[UserProcess]:
    """``processes`` checked: each a function or ``"module:function"`` (a module name or a
    .py file, imported once); a bad entry is a one-line error naming its place."""
    if processes is None:
        return []
    if isinstance(processes, (str, bytes)) or not isinstance(processes, Sequence):
        raise ValueError(f"{SETTING} must be a list of functions or 'module:function' names, "
                         f"got {processes!r}")
    out = []
    for i, entry in enumerate(processes):
        where = f"{SETTING}[{i}]"
        if isinstance(entry, str):
            module, colon, name = entry.rpartition(":")
            if not colon or not module or not name.isidentifier():
                raise ValueError(f"{where} must be 'module:function' (a module name or a .py "
                                 f"file, then the function's name), got {entry!r}")
            fn = getattr(import_user_module(module, where), name, None)
            if fn is None:
                raise ValueError(f"{where} {entry}: {module} has no function {name!r}")
            entry = fn
        if not callable(entry):
            raise ValueError(f"{where} must be a function fn(env, sim) that returns a "
                             f"generator, got {entry!r}")
        out.append(entry)
    return out


def start(processes: list[UserProcess], sim: Simulation) -> None:
    """Start each process on ``sim.env`` (now, after the simulation's own)."""
    for i, fn in enumerate(processes):
        body = fn(sim.env, sim)
        if not isinstance(body, GeneratorType):
            name = getattr(fn, "__qualname__", repr(fn))
            raise ValueError(f"{SETTING}[{i}] {name}(env, sim) must return a generator (a "
                             f"function with a yield, e.g. 'yield env.timeout(1.0)'), got "
                             f"{body!r}")
        sim.env.process(body)
