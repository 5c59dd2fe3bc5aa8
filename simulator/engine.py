"""The simulated serving engine: SimPy processes on one environment that drive policies/
schedulers over a cost model, for one replica or a cluster of them behind a router. Every
decision is the scheduler's; this module only keeps time: a window's schedule on the engine
thread, its k steps on the GPU (through the pipeline stages), its output processing and
delivery, with overlap scheduling and time_scale as docs/simulator.md ("The engine's
timeline") describes them."""

from __future__ import annotations

import gc
import operator
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import fields
from itertools import repeat

import numpy as np
import simpy
from simpy.core import StopSimulation
from tqdm import tqdm

from common.client import PROGRESS_BAR_FORMAT, Client
from common.model_spec import ModelSpec
from common.window_record import window_record
from policies.batch import Batch
from policies.early_rejection import EarlyRejection
from policies.hooks import checked_router
from policies.late_schedule import LateSchedule
from policies.request import Request, RequestState
from policies.routers import ReplicaLoad, RoundRobin, Router
from policies.scheduler import Scheduler, SchedulerStats
from policies.speculation import SpecDecodeStats
from simulator.clock import PowerClock
from simulator.cost_model import DraftKV, step_time_fn, window_draft_times, window_shapes
from simulator.disaggregation import Disaggregation, HandoffLog, check_roles
from simulator.events import At, call_at
from simulator.front_end import apply_delivery_times, arrivals, client_finished, deliver
from simulator.hardware import HardwareSpec
from simulator.link import LinkSpec
from simulator.memory import blocks_per_engine
from simulator.outcome import (
    ClusterResult,
    ReplicaSpec,
    SimResult,
    StepRows,
    cluster_total,
    step_row,
)
from simulator.overhead import (
    OverheadSpec,
    scale_overhead,
    schedule_time,
    sse_chunks,
    window_output_times,
)
from simulator.processes import Simulation, UserProcess, start, user_processes
from simulator.replica_state import FinishHook, ReplicaSim, Shared, Window

_STATE, _TOKEN_TIMES = operator.attrgetter("state"), operator.attrgetter("token_times")
_OUTPUTS = operator.attrgetter("num_output_tokens")
_EPS = 1e-9  # seconds: busy-until times this close to now count as now (float round-off)
# backend.time_scale's largest value. It multiplies every priced cost (validation varies it by
# 1%; a GPU ten times slower is 10): up to 1000, a run of less than 50 days of unscaled service
# keeps its clock below 2^32 s, where float64 seconds still resolve a microsecond.
MAX_TIME_SCALE = 1000.0


def simulate(requests: list[Request], make_scheduler: Callable[[int], Scheduler],
             model: ModelSpec, hw: HardwareSpec, overhead: OverheadSpec, *,
             block_size: int = 16, gpu_memory_utilization: float = 0.9,
             max_model_len: int | None = None, num_blocks: int | None = None,
             stream_per_step: bool = False, time_scale: float = 1.0,
             max_concurrency: int | None = None, progress: bool = True,
             on_finish: FinishHook | None = None, group_decodes: bool = True,
             steps: StepRows | None = None,
             processes: Sequence[UserProcess | str] | None = None) -> SimResult:
    """Serve ``requests`` (fresh ones: their timings are filled in) and return the run's summary.

    ``make_scheduler(num_blocks)`` builds one virtual engine's scheduler; ``max_model_len``
    (default: the model's) is only used to check that the KV cache holds one such request.
    With ``max_concurrency`` a request's arrival_time becomes the time the client sent it.
    ``on_finish(requests, 0, runs)`` is called with each window's finished requests as their
    token times become final (``replica_state.FinishHook``). ``steps``: an empty StepRows that
    gets each window's row as it closes (a caller may read them while the run goes on); the
    result's ``steps``. ``processes``: SimPy processes of the caller's own, run beside the
    simulation's (simulator/processes.py).
    """
    spec = ReplicaSpec(make_scheduler, model, hw, overhead, block_size, gpu_memory_utilization,
                       max_model_len, num_blocks, stream_per_step, time_scale,
                       group_decodes=group_decodes)
    return simulate_cluster(requests, [spec], RoundRobin(), max_concurrency=max_concurrency,
                            progress=progress, on_finish=on_finish,
                            steps=None if steps is None else [steps],
                            processes=processes).total


def simulate_cluster(requests: list[Request], replicas: Sequence[ReplicaSpec], router: Router,
                     *, max_concurrency: int | None = None, progress: bool = True,
                     on_finish: FinishHook | None = None,
                     steps: Sequence[StepRows] | None = None,
                     processes: Sequence[UserProcess | str] | None = None,
                     decode_router: Router | None = None, link: LinkSpec | None = None,
                     handoffs: HandoffLog | None = None,
                     early_rejection: tuple[float | None, float | None] | None = None
                     ) -> ClusterResult:
    """Serve ``requests`` on the replicas, each request sent to the one ``router`` picks.
    ``steps``: each replica's StepRows to fill, and ``processes``, as ``simulate``'s.

    Disaggregated (a replica's ``role`` prefill or decode): ``router`` picks among the prefill
    and mixed replicas, ``decode_router`` (default round_robin) the decode replica a prefilled
    request continues on, its KV sent over ``link`` (simulator/disaggregation.py); ``handoffs``
    gets each request's prefill replica and transfer times. ``early_rejection``: the default
    (TTFT, TPOT) targets in ms of Mooncake-style early rejection at arrival
    (policies/early_rejection.py; a request's SLO class's targets first); None: off."""
    if not replicas:
        raise ValueError("cluster.num_replicas must be >= 1, got 0")
    cluster = len(replicas) > 1
    roles = [spec.role for spec in replicas]
    disaggregated = check_roles(roles, link)
    if steps is not None and (len(steps) != len(replicas)
                              or any(len(s) or s.cluster != cluster for s in steps)):
        raise ValueError(f"simulate: steps must be {len(replicas)} empty StepRows"
                         f"{' for a cluster' if cluster else ''}, one a replica")
    # (three passes in C; the first request that is not fresh is looked for only if one is not)
    if not all(map(operator.is_, map(_STATE, requests), repeat(RequestState.WAITING))) \
            or any(map(_TOKEN_TIMES, requests)) or any(map(_OUTPUTS, requests)):
        served = next(r for r in requests if r.state is not RequestState.WAITING
                      or r.token_times or r.num_output_tokens)
        raise ValueError(f"simulate needs fresh requests: request {served.request_id} has "
                         "already been served")
    users = user_processes(processes)
    env = simpy.Environment()
    client = Client(requests, max_concurrency)  # (it sends them in arrival order)
    wall = time.perf_counter()
    with tqdm(total=len(requests), disable=not progress, desc="simulating",
              bar_format=PROGRESS_BAR_FORMAT) as bar:
        shared = Shared(env, client, bar, on_finish, cluster)
        # a router's indices are positions in its pool (all replicas where none decodes only)
        pools = ([i for i, r in enumerate(roles) if r != "decode"],
                 [i for i, r in enumerate(roles) if r == "decode"])
        at = {i: n for pool in pools for n, i in enumerate(pool)}
        sims = [_replica(shared, i, spec, StepRows(cluster) if steps is None else steps[i],
                         at[i])
                for i, spec in enumerate(replicas)]
        replica_of: dict[int, int] = {}
        entry = pd = None
        if early_rejection is not None and not disaggregated:
            raise ValueError("cluster.early_rejection applies to a disaggregated cluster only")
        if disaggregated:
            entry = [sims[i] for i in pools[0]]
            pd = Disaggregation(link, checked_router(decode_router or RoundRobin()),
                                [s for s in sims if s.role == "prefill"],
                                [sims[i] for i in pools[1]], replica_of, handoffs)
            if early_rejection is not None:
                pd.rejection = EarlyRejection(
                    [_prefill_time(replicas[i]) for i in pools[0]],
                    [_decode_step_time(replicas[i]) for i in pools[1]], *early_rejection)
            for sim in sims:
                if sim.role == "prefill":
                    sim.sends_kv = pd
                elif sim.role == "decode":
                    sim.takes_kv = pd
        own = [env.process(arrivals(shared, sims, checked_router(router), replica_of, entry,
                                    None if pd is None or pd.rejection is None else pd.reject))]
        for sim in sims:
            overlap = sim.schedulers[0].overlap
            for v in range(len(sim.schedulers)):
                own.append(env.process(_engine_overlap(sim, v) if overlap else _engine(sim, v)))
        start(users, Simulation(env, sims, client, requests))
        # the run ends with the simulation's own processes (a user's may wait for ever)
        env.all_of(own).callbacks.append(StopSimulation.callback)
        # The run makes millions of lists (token times, block tables) that live to its end
        # and few reference cycles: the cyclic collector would rescan them again and again
        # (a large share of a long run's time) and free almost nothing. Reference counting still
        # frees everything acyclic; the collector runs again once the run is over.
        collecting = gc.isenabled()
        gc.disable()
        try:
            env.run()
        finally:
            if collecting:
                gc.enable()
    if client.num_unsent:
        raise RuntimeError(f"{client.num_unsent} requests were never sent")
    for sim in sims:
        if any(sim.arrivals_left):
            raise RuntimeError(f"replica {sim.index}: requests routed to it never arrived")
    routed: list[list[Request]]
    if len(sims) == 1:
        where, routed = [0] * len(requests), [list(requests)]
    else:
        where = [replica_of.get(id(r), -1) for r in requests]  # (-1: rejected at arrival)
        routed = [[] for _ in sims]
        for r, i in zip(requests, where, strict=True):
            if i >= 0:
                routed[i].append(r)
    for sim, mine in zip(sims, routed, strict=True):  # the finished ones are final already
        apply_delivery_times([r for r in mine if r.finish_time is None], sim.delivery)
    wall = time.perf_counter() - wall
    per = [_result(sim, mine, wall) for sim, mine in zip(sims, routed, strict=True)]
    total = per[0] if len(per) == 1 else cluster_total(per, requests, wall)
    return ClusterResult(total, per, where, list(replicas))


def _prefill_time(spec: ReplicaSpec) -> Callable[[int, int], float]:
    """Seconds of a step prefilling m prompts of n tokens on this replica (the cost model)."""
    first = step_time_fn(spec.model, spec.hw)
    return lambda n, m: first(0, 0, 0, [(n, 0, True)] * m) * spec.time_scale


def _decode_step_time(spec: ReplicaSpec) -> Callable[[int, int], float]:
    """Seconds of a decode step of n sequences over kv tokens on this replica."""
    first = step_time_fn(spec.model, spec.hw)
    return lambda n, kv: first(n, kv, kv // max(n, 1), ()) * spec.time_scale


def _replica(shared: Shared, index: int, spec: ReplicaSpec, steps: StepRows,
             pool_index: int) -> ReplicaSim:
    num_blocks = spec.num_blocks
    if num_blocks is None:
        num_blocks = blocks_per_engine(spec.model, spec.hw, block_size=spec.block_size,
                                       gpu_memory_utilization=spec.gpu_memory_utilization,
                                       max_model_len=spec.max_model_len)
    elif num_blocks < 1:
        raise ValueError(f"backend.num_blocks must be >= 1, got {num_blocks}")
    time_scale = spec.time_scale
    if not 0.0 < time_scale <= MAX_TIME_SCALE:  # NaN fails too
        raise ValueError(f"backend.time_scale must be a number in (0, {MAX_TIME_SCALE:g}], "
                         f"got {time_scale}")
    overhead = spec.overhead
    if time_scale != 1.0:
        overhead = scale_overhead(overhead, time_scale)
    pp = spec.hw.pp
    schedulers = [spec.make_scheduler(num_blocks) for _ in range(pp)]
    speculation = schedulers[0].speculation
    if speculation is not None and speculation.acceptance is None:
        raise ValueError(f"spec.method={speculation.method} needs workload.acceptance in the "
                         "simulator ({rate: r}, {rates: [...]} or {trace: file.csv}): what a "
                         "draft accepts is the workload's there (docs/speculative_decoding.md)")
    if spec.role == "prefill" and schedulers[0].overlap:
        raise ValueError(f"replica {index}: scheduler.overlap on a prefill replica is not "
                         "modelled (its requests leave once prefilled)")
    if spec.group_decodes and spec.role != "prefill":  # (a prefill replica decodes nothing)
        for sched in schedulers:
            sched.group_decodes()
    if schedulers[0].overlap and pp > 1:  # Scheduler.overlap: wherever it is configured
        raise ValueError(f"scheduler.overlap with parallel.pipeline_parallel_size = {pp} is not "
                         "modelled (1 only)")
    env = shared.env
    stages = [simpy.Resource(env) for _ in range(pp)] if pp > 1 else []  # FIFO, capacity one
    return ReplicaSim(env, shared, index, stages,
                      schedulers, spec.model, spec.hw, overhead, spec.stream_per_step,
                      [None] * pp, PowerClock(spec.model, spec.hw), time_scale,
                      ReplicaLoad(pool_index, schedulers, spec.group), num_blocks, [0] * pp,
                      steps=steps, group_delivery=[np.zeros(0)] * pp, role=spec.role,
                      draft_kv=DraftKV() if speculation is not None
                      and speculation.draft_step_time is not None else None)


def _result(sim: ReplicaSim, requests: list[Request], wall: float) -> SimResult:
    stats = SchedulerStats()
    for f in fields(SchedulerStats):
        setattr(stats, f.name, sum(getattr(s.stats, f.name) for s in sim.schedulers))
    duration = sim.last_delivery
    pp = len(sim.schedulers)
    spec = None
    if sim.schedulers[0].speculation is not None:
        spec = SpecDecodeStats()
        for s in sim.schedulers:
            spec.add(s.spec_stats)
    return SimResult(
        requests=requests, duration=duration, wall_seconds=wall, stats=stats,
        num_windows=stats.num_windows, num_finished=sim.num_finished, num_blocks=sim.num_blocks,
        gpu_busy_fraction=sim.gpu_busy / (pp * duration) if duration > 0 else 0.0,
        cpu_busy_fraction=sim.cpu_busy / duration if duration > 0 else 0.0, steps=sim.steps,
        spec_decode=spec)


def _engine(sim: ReplicaSim, v: int) -> Generator:
    """Virtual engine ``v``'s loop: schedule, run the window on the GPU, hand off its outputs."""
    env, sched = sim.env, sim.schedulers[v]
    asynchronous = sim.overhead.async_output_processing
    pending: Window | None = None  # async: last step's outputs, processed after the next schedule
    while True:
        now = env.now
        while sim.cpu_free - now > _EPS:  # the engine thread is busy (outputs, other engines)
            yield At(env, sim.cpu_free)
            now = env.now
        batch = sched.schedule(now) if sched.has_unfinished else None
        if batch is None:
            if pending is not None:
                _claim_output_processing(sim, pending, pending.batch.num_steps - 1)
                pending = None
            if _all_done(sim, v):
                return
            sim.wake[v] = env.event()
            yield sim.wake[v]
            continue
        win = _open_window(sim, batch, v, now)
        sim.cpu_free = now + win.schedule_cost
        if pending is not None:
            _claim_output_processing(sim, pending, pending.batch.num_steps - 1)
            pending = None
        yield env.timeout(win.schedule_cost)  # (at now + cost, as cpu_free)
        yield from _run_steps(sim, win)
        _close_window(sim, sched, win)
        sim.steps.rows.append(_window_row(sim, win, v))
        if asynchronous and sim.overhead.defer_last_output:
            pending = win
        else:  # blocking: every step's outputs now; async, not deferred: the last step's
            _claim_output_processing(sim, win, win.batch.num_steps - 1 if asynchronous else 0)


def _all_done(sim: ReplicaSim, v: int) -> bool:
    """Whether virtual engine ``v`` is done when its scheduler formed no batch: nothing more
    arrives and nothing is left; work left that no batch takes is an error (Scheduler.stalled)."""
    if sim.arrivals_left[v] or sim.shared.client.num_unsent:
        return False
    if sim.takes_kv is not None and sim.takes_kv.prefilling():  # a hand-off may still come
        return False
    stalled = sim.schedulers[v].stalled()
    if stalled:  # the policy's doing (a user's, as a rule): the run's one-line error
        raise ValueError(f"virtual engine {v}: {stalled}")
    return True


def _engine_overlap(sim: ReplicaSim, v: int) -> Generator:
    """Virtual engine ``v``'s loop with overlap scheduling: schedule and launch window n+1, then
    process window n's outputs and update() it while window n+1 runs (formed late when the
    scheduler defers: policies/late_schedule.py)."""
    env, sched = sim.env, sim.schedulers[v]
    last: Window | None = None  # launched; its outputs not processed yet
    gpu_free = 0.0
    late = LateSchedule()
    processed = 0  # steps of ``last`` whose outputs are claimed
    while True:
        now = env.now
        while sim.cpu_free - now > _EPS:
            yield At(env, sim.cpu_free)
            now = env.now
        if last is not None and sched.defers_schedule():
            at = late.schedule_at(last.batch, last.gpu_done[0] - last.stage_times[0])
            if at is not None and at > now:
                # while it waits, the thread processes each step of the window in flight
                # that finishes meanwhile (the engine polls it: real_backend/engine.py), when
                # it finishes: claimed then, not now, so that work arriving in between (a
                # request's front-end parse) is not queued behind it
                while processed < len(last.gpu_done) and last.gpu_done[processed] <= at:
                    call_at(env, max(now, last.gpu_done[processed]),
                            lambda w=last, j=processed: _claim_output_processing(sim, w, j, j + 1))
                    processed += 1
                yield At(env, at)
                now = env.now
                while sim.cpu_free - now > _EPS:
                    yield At(env, sim.cpu_free)
                    now = env.now
        batch = sched.schedule(now) if sched.has_unfinished else None
        win = None
        if batch is not None:
            win = _open_window(sim, batch, v, now, gpu_free)
            late.observe_form(win.schedule_cost)
            sim.cpu_free = now + win.schedule_cost
            gpu_free = win.gpu_done[-1]
        if last is not None:
            late.observe_window(last.batch, sum(last.stage_times))
            for j in range(processed, len(last.gpu_done)):  # each step's once it is done
                _claim_output_processing(sim, last, j, j + 1, now=last.gpu_done[j])
            yield At(env, max(now, sim.cpu_free))
            _close_window(sim, sched, last)
            sim.steps.rows.append(_window_row(sim, last, v))
        elif win is None:
            if _all_done(sim, v):
                return
            sim.wake[v] = env.event()
            yield sim.wake[v]
        last, processed = win, 0


def _open_window(sim: ReplicaSim, batch: Batch, v: int, now: float,
                 gpu_free: float | None = None) -> Window:
    """Cost a window scheduled ``now``: GPU time per step, CPU time per phase. With overlap
    (``gpu_free``: when the window before leaves the GPU) its steps' times are known now."""
    spec, k = sim.overhead, batch.num_steps
    overlap = gpu_free is not None
    # the scheduler discards samples past max_tokens: how many sequences end at each step
    ending = [0] * (k + 1) if k > 1 and not overlap else None
    surplus: list[int] = []  # filled where a sequence emits several tokens a step
    shapes = window_shapes(batch, ending, surplus)
    if k == 1:  # every sampling sequence still owes at least one token
        delivered = [shapes[0].num_sampled - surplus[1] if surplus else shapes[0].num_sampled]
    else:
        if ending is None:  # the outputs of the window in flight are still placeholders
            ending = [0] * (k + 1)
            for s in batch.seqs:
                if s.num_placeholders:  # the steps its expected tokens take
                    ending[min(s.steps_for(s.num_placeholders), k)] += 1
        delivered = [0] * k
        alive = sum(ending) - ending[0]
        for j in range(k):
            delivered[j] = alive
            alive -= ending[j + 1]
    # ``delivered`` counts the sequences streaming at each step (one SSE chunk each), the
    # tokens they deliver are more where a sequence emits several a step
    streaming = delivered
    if surplus:
        delivered = [n + x for n, x in zip(streaming, surplus, strict=False)]
    if sim.shared.cluster:  # fresh requests admitted now leave the router's queued tokens
        load = sim.load
        for s in batch.seqs:
            req = s.request  # its first chunk starts after its cached prefix
            if s.is_prefill and s.num_cached_tokens == req.num_cached_prompt_tokens \
                    and not req.num_preemptions:
                load.queued_prompt_tokens -= req.prompt_len
    chunks = sse_chunks(spec, streaming, sim.stream_per_step)
    out_cost = window_output_times(spec, [s.num_seqs for s in shapes], delivered, chunks)
    cost = schedule_time(spec, batch.num_seqs, shapes[0].num_tokens, shapes[0].kv_tokens,
                         batch.num_steps, overlap, shapes[0].num_prefill_seqs,
                         sim.model.num_layers)
    # the GPU starts the window once it is scheduled (pipeline stages: a close lower bound),
    # with overlap once the window before it is done too
    start = now + cost if not overlap else max(now + cost, gpu_free)
    gpu = sim.clock.window_times(shapes, start, sim.time_scale)
    if sim.draft_kv is not None:  # the draft model's forwards
        spec, scale = sim.schedulers[v].speculation, sim.time_scale
        draft = window_draft_times(batch, spec.draft_step_time, spec.num_tokens, sim.draft_kv)
        gpu = [t + d * scale for t, d in zip(gpu, draft, strict=True)]
    win = Window(batch, cost, gpu, out_cost, delivered, chunks, shapes[0], now, engine=v)
    if overlap:
        for dt in gpu:
            start += dt
            win.gpu_done.append(start)
    sim.cpu_busy += win.schedule_cost
    sim.gpu_busy += sum(win.stage_times) * max(len(sim.stages), 1)
    return win


def _window_row(sim: ReplicaSim, win: Window, v: int) -> tuple:
    """steps.csv's row of a closed window (StepRows' columns), in the real engine's columns where
    they mean the same (gpu_s per pipeline stage; the CPU before the GPU starts is one term,
    schedule_prepare_s); window ids count per virtual engine. In a cluster each row also names
    its replica and that replica's load as the window closes (the per-replica load figure)."""
    batch = win.batch
    first = win.first
    record = window_record(batch.window_id, win.t_start, batch.num_steps, batch.num_seqs,
                           first.num_prefill_seqs, first.num_tokens, first.kv_tokens,
                           len(batch.preempted), batch.num_wasted_steps)
    load = ()
    if sim.shared.cluster:
        now = sim.load
        load = (sim.index, now.outstanding, sum(s.num_waiting for s in sim.schedulers),
                sum(s.num_running for s in sim.schedulers), now.kv_blocks_used)
    return step_row(v, record, win.schedule_cost, win.stage_times, load)


def _run_steps(sim: ReplicaSim, win: Window) -> Generator:
    """The window's k steps on the GPU (through every pipeline stage when pp > 1)."""
    env, k = sim.env, win.batch.num_steps
    asynchronous = sim.overhead.async_output_processing
    if not sim.stages:
        # One engine owns the GPU and the engine thread, so the whole window is known now:
        # one wake-up, and the async output processing of steps 1..k-1 claimed in advance.
        t = env.now
        for j, dt in enumerate(win.stage_times):
            t += dt
            win.gpu_done.append(t)
            if asynchronous and j < k - 1:
                _claim_output_processing(sim, win, j, j + 1, now=t)
        yield At(env, t)
        return
    for j, dt in enumerate(win.stage_times):
        if dt > 0.0:  # a step nobody takes part in runs nothing and shares its GPU time key
            for stage in sim.stages:
                turn = stage.request()
                yield turn
                yield env.timeout(dt)
                stage.release(turn)
        win.gpu_done.append(env.now)
        if asynchronous and j < k - 1:
            _claim_output_processing(sim, win, j, j + 1)


def _close_window(sim: ReplicaSim, sched: Scheduler, win: Window) -> None:
    """Hand the window to ``update()`` with each step's GPU completion time."""
    finished = sched.update(win.batch, win.gpu_done)
    if finished:
        sim.num_finished += len(finished)
        sim.shared.pbar.update(len(finished))
        if sim.shared.cluster:
            load = sim.load
            load.outstanding -= len(finished)
            load.outstanding_tokens -= sum(r.prompt_len + r.max_tokens for r in finished)
        if sim.draft_kv is not None:
            sim.draft_kv.forget(finished)
    win.finished = finished
    if sim.sends_kv is not None:  # a prefill replica: its prefilled requests leave
        sim.sends_kv.hand_off(sim, sched, win)
    if win.delivery_known:
        client_finished(sim, win)


def _claim_output_processing(sim: ReplicaSim, win: Window, first: int, last: int | None = None,
                             now: float | None = None) -> None:
    """Queue output processing of steps [first, last) on the engine thread at time ``now``."""
    t = max(sim.env.now if now is None else now, sim.cpu_free)
    start = t
    last = win.batch.num_steps if last is None else last
    for j in range(first, last):
        t += win.out_cost[j]
        win.out_done.append(t)
    sim.cpu_busy += t - start
    sim.cpu_free = t
    if last == win.batch.num_steps:
        deliver(sim, win)

