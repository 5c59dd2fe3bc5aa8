"""What a simulation takes per replica (``ReplicaSpec``) and gives back: a run's summary
(``SimResult``), a cluster's (``ClusterResult``, its whole made by ``cluster_total``), and
steps.csv's rows (``StepRows``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from common.model_spec import ModelSpec
from common.window_record import WINDOW_COLUMNS, stage_cells, window_columns
from policies.request import Request
from policies.scheduler import Scheduler, SchedulerStats
from policies.speculation import SpecDecodeStats
from simulator.hardware import HardwareSpec
from simulator.overhead import OverheadSpec

# the window record and the stage timings (common/window_record.py) after the virtual engine
STEP_COLUMNS = window_columns(lead=("virtual_engine",))
CLUSTER_STEP_COLUMNS = ("replica", "outstanding", "num_waiting", "num_running", "kv_blocks_used")
# A stored row (step_row): the virtual engine, the window record, the CPU's time before the GPU,
# each step's GPU time (a tuple: gpu_s and gpu_step_s are made of it when read), then in a
# cluster the replica and its load. Read by name (StepRows.column), never by position.
STORED_FIELDS = ("virtual_engine", *WINDOW_COLUMNS, "schedule_prepare_s", "gpu_step_times",
                 *CLUSTER_STEP_COLUMNS)
_CPU = STORED_FIELDS.index("schedule_prepare_s")


def step_row(virtual_engine: int, record: tuple, schedule_prepare_s: float,
             gpu_step_times: Sequence[float], load: tuple = ()) -> tuple:
    """A window's stored row in STORED_FIELDS' order (``record``: common.window_record's;
    ``load``: a cluster's replica and its load, CLUSTER_STEP_COLUMNS)."""
    return (virtual_engine, *record, schedule_prepare_s, tuple(gpu_step_times), *load)


class StepRows(Sequence[dict[str, Any]]):
    """steps.csv's rows, one per window, kept as tuples (a 1M-request run has hundreds of
    thousands): each read as a dict of its columns, or rows as columns (``columns_of``)."""

    def __init__(self, cluster: bool, rows: list[tuple] | None = None) -> None:
        self.cluster = cluster
        self.columns = STEP_COLUMNS + (CLUSTER_STEP_COLUMNS if cluster else ())
        self.rows: list[tuple] = rows if rows is not None else []

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self._dict(row) for row in self.rows[i]]
        return self._dict(self.rows[i])

    def __iter__(self):
        return map(self._dict, self.rows)

    def _dict(self, row: tuple) -> dict[str, Any]:
        return dict(zip(self.columns, self._cells(row), strict=True))

    def column(self, name: str) -> list[Any]:
        """One stored field (STORED_FIELDS) of every row, in order."""
        i = STORED_FIELDS.index(name)
        return [row[i] for row in self.rows]

    @staticmethod
    def _cells(row: tuple) -> tuple:
        # stored: the stage times per step, made STAGE_COLUMNS' cells when read
        return (*row[:_CPU], *stage_cells(row[_CPU], row[_CPU + 1]), *row[_CPU + 2:])

    def columns_of(self, start: int, end: int) -> list[Sequence[Any]]:
        """Rows start..end-1's cells as columns, in ``columns``' order: steps.csv's rows as
        the result files write them, a batch at a time (experiments.streamed_files)."""
        return list(zip(*map(self._cells, self.rows[start:end]))) or [()] * len(self.columns)


@dataclass(slots=True)
class SimResult:
    """What one simulation produced; per-request timings are on the requests themselves."""

    requests: list[Request]
    duration: float  # simulated seconds from t=0 to the last token's delivery
    wall_seconds: float
    stats: SchedulerStats  # summed over the virtual engines
    num_windows: int
    num_finished: int
    num_blocks: int  # KV blocks per virtual engine
    gpu_busy_fraction: float  # of duration, averaged over the pipeline stages
    cpu_busy_fraction: float  # of duration, the engine thread
    steps: StepRows  # one row per window, steps.csv (the real engine's columns)
    # speculative decoding's drafts and acceptance, summed over the virtual engines; None: off
    spec_decode: SpecDecodeStats | None = None


@dataclass(slots=True)
class ReplicaSpec:
    """One replica of a cluster: its model, GPU, CPU costs and how to make its schedulers."""

    make_scheduler: Callable[[int], Scheduler]
    model: ModelSpec
    hw: HardwareSpec
    overhead: OverheadSpec
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    num_blocks: int | None = None
    stream_per_step: bool = False
    time_scale: float = 1.0
    group: int = 0  # the replica group it belongs to (a heterogeneous cluster)
    # keep each scheduler's decoders as one group where it can (Scheduler.group_decodes):
    # the same windows, in time independent of the running count; False: one by one
    group_decodes: bool = True
    role: str = "mixed"  # prefill, decode or mixed (serves whole requests): disaggregation


@dataclass(slots=True)
class ClusterResult:
    """A cluster's run: the whole (``total``: stats, busy fractions and steps summed or averaged
    over replicas) and each replica's own, and the replica each request went to."""

    total: SimResult
    replicas: list[SimResult]  # per replica; requests: the ones routed to it
    replica_of: list[int]  # per request, in the order given (-1: rejected at arrival)
    specs: list[ReplicaSpec]


def cluster_total(per: list[SimResult], requests: list[Request], wall: float) -> SimResult:
    """The cluster as one result: counters summed, busy fractions averaged over replicas (of the
    cluster's duration), steps rows merged in time order (each names its replica)."""
    stats = SchedulerStats()
    for f in fields(SchedulerStats):
        setattr(stats, f.name, sum(getattr(r.stats, f.name) for r in per))
    duration = max(r.duration for r in per)
    gpu = sum(r.gpu_busy_fraction * r.duration for r in per)
    cpu = sum(r.cpu_busy_fraction * r.duration for r in per)
    n = len(per)
    steps = StepRows(True, sorted((row for r in per for row in r.steps.rows),
                                  key=lambda row: row[2]))  # by t_start
    spec = None
    if any(r.spec_decode is not None for r in per):
        spec = SpecDecodeStats()
        for r in per:
            if r.spec_decode is not None:
                spec.add(r.spec_decode)
    return SimResult(
        requests=requests, duration=duration, wall_seconds=wall, stats=stats,
        num_windows=stats.num_windows, num_finished=sum(r.num_finished for r in per),
        num_blocks=sum(r.num_blocks for r in per),
        gpu_busy_fraction=gpu / (n * duration) if duration > 0 else 0.0,
        cpu_busy_fraction=cpu / (n * duration) if duration > 0 else 0.0, steps=steps,
        spec_decode=spec)
