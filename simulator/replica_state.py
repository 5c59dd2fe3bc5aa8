"""The simulator's state as it runs: a replica's (``ReplicaSim``: its schedulers, engine thread,
API server, GPU and clock), what the replicas share (``Shared``), and a window in flight."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import simpy
from tqdm import tqdm

from common.client import Client
from common.model_spec import ModelSpec
from policies.batch import Batch
from policies.request import Request
from policies.routers import ReplicaLoad
from policies.scheduler import Scheduler
from simulator.clock import PowerClock
from simulator.hardware import HardwareSpec
from simulator.outcome import StepRows
from simulator.overhead import OverheadSpec
from simulator.step_shape import StepShape

if TYPE_CHECKING:
    from simulator.cost_model import DraftKV

# Called with a window's finished requests once their token times are final (delivery times),
# their replica, and None or, for a decode group's window, (log, runs): request i's times are
# its token_times followed by log[runs[i][0]:runs[i][1]] (the group's delivery times, kept as
# one array). After the hook, a request whose token_times is still a list gets its run added.
FinishHook = Callable[[list[Request], int, tuple[np.ndarray, list[tuple[int, int]]] | None], None]


@dataclass(slots=True, eq=False)
class Window:
    """A window in flight: its batch, its costs per step, and what of it is done."""

    batch: Batch
    schedule_cost: float
    stage_times: list[float]  # per step, on each pipeline stage
    out_cost: list[float]  # per step, engine-thread output processing
    delivered: list[int]  # per step, tokens the client receives
    chunks: list[int]  # per step, SSE chunks the API server streams
    first: StepShape  # step 1's shape
    t_start: float  # when it was scheduled
    gpu_done: list[float] = field(default_factory=list)
    out_done: list[float] = field(default_factory=list)
    finished: list[Request] | None = None  # by update(); None before
    delivery_known: bool = False  # its tokens' delivery times are in sim.delivery
    engine: int = 0  # the virtual engine that runs it


@dataclass(slots=True, eq=False)
class Shared:
    """What the replicas of one simulation share: the clock, the client and the progress bar."""

    env: simpy.Environment
    client: Client
    pbar: tqdm
    on_finish: FinishHook | None
    cluster: bool  # more than one replica: routing loads are kept, steps rows name the replica
    client_wake: simpy.Event | None = None  # the arrival process waits for a finish


@dataclass(slots=True, eq=False)
class ReplicaSim:
    """One replica: its virtual engines' schedulers, engine thread, API server and GPU."""

    env: simpy.Environment
    shared: Shared
    index: int
    stages: list[simpy.Resource]  # pipeline stages; none when pp == 1: one engine owns the GPU
    schedulers: list[Scheduler]
    model: ModelSpec
    hw: HardwareSpec
    overhead: OverheadSpec
    stream_per_step: bool
    wake: list[simpy.Event | None]  # an idle virtual engine waits for work
    clock: PowerClock  # the GPU's power-limited SM clock (off unless the profile sets it)
    time_scale: float  # multiplies each step's GPU time (the CPU costs come scaled in overhead)
    load: ReplicaLoad  # what a router sees of it
    num_blocks: int
    arrivals_left: list[int] = field(default_factory=list)
    num_sent: int = 0  # requests routed here: the next goes to virtual engine num_sent % pp
    cpu_free: float = 0.0  # when the engine thread is next idle
    api_free: float = 0.0  # when the separate API-server process is next idle
    delivery: dict[float, float] = field(default_factory=dict)  # step's GPU done -> delivered
    # per virtual engine, the delivery time of each decode group position (policies/
    # decode_group.py): its finished members' times are slices of it
    group_delivery: list[np.ndarray] = field(default_factory=list)
    last_delivery: float = 0.0
    gpu_busy: float = 0.0  # stage-seconds
    cpu_busy: float = 0.0
    num_finished: int = 0
    steps: StepRows = field(default_factory=lambda: StepRows(False))
    # prefill/decode disaggregation (simulator/disaggregation.py): the cluster's hand-off state
    # on a prefill replica (it sends KV) and on a decode replica (it takes KV); None otherwise
    sends_kv: Any = None
    takes_kv: Any = None
    role: str = "mixed"
    # speculative decoding with a draft model: how far each request's draft KV is computed
    draft_kv: DraftKV | None = None

    def stall(self, until: float) -> None:
        """Hold the engine thread until ``until`` (a user's process: a replica that fails and
        comes back with its KV cache, a long pause): nothing is scheduled and no output is
        processed before then; the windows already on the GPU finish, and requests routed here
        meanwhile wait for it."""
        if until > self.cpu_free:
            self.cpu_free = until
