"""The real backend's wall-clock serving loop: release requests as their source hands them over
(an offline run's benchmark client, or the HTTP server's inbox: real_backend/request_source.py),
run each scheduler window on the device, hand every step's tokens to the scheduler with their
delivery times (with overlap scheduling, the next window launched before the last one's tokens
are collected) and back to the source."""

from __future__ import annotations

import dataclasses
import gc
import os
import platform
import time
from collections.abc import Callable, Mapping, MutableSequence
from contextlib import nullcontext
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from common.client import PROGRESS_BAR_FORMAT, Client
from common.model_spec import ModelSpec
from common.parallel import ParallelConfig
from common.window_record import stage_cells, window_record, window_row
from policies.batch import Batch
from policies.late_schedule import LateSchedule
from policies.request import Request
from policies.scheduler import Scheduler
from policies.speculation import SpecDecodeStats
from real_backend.build import build_rank_runner, build_runner, runner_shape  # noqa: F401
from real_backend.config import BackendConfig
from real_backend.parallel import BuildRunner, Workers, rank_config
from real_backend.request_source import ClientSource, RequestSource
from real_backend.runner import LaunchedWindow, ModelRunner, WindowResult


@dataclass(slots=True)
class RealResult:
    duration: float  # seconds from the run's start to the last token
    stats: dict[str, Any]
    steps: list[dict[str, Any]]  # one row per window, for steps.csv
    token_ids: dict[int, list[int]] | None = None  # request_id -> output ids (save_token_ids)
    spec_decode: SpecDecodeStats | None = None  # speculative decoding's drafts, as verified


# sees each served window as it ends: (batch, its result, wall seconds of run_window)
OnWindow = Callable[[Batch, WindowResult, float], None]


class Clock:
    """Seconds since ``start()``: the clock of arrival times, delivery times and the duration."""

    def __init__(self) -> None:
        self.t0 = perf_counter()

    def start(self) -> None:
        self.t0 = perf_counter()

    def __call__(self) -> float:
        return perf_counter() - self.t0


def fill_prompt_tokens(requests: list[Request], spec: ModelSpec, seed: int) -> None:
    """Give length-only requests seeded random prompt ids; check given ids fit the vocabulary."""
    rng = np.random.default_rng(seed)
    for r in requests:
        if r.prompt_token_ids is None:
            r.prompt_token_ids = rng.integers(0, spec.vocab_size, r.prompt_len).tolist()
        elif max(r.prompt_token_ids) >= spec.vocab_size:
            raise ValueError(f"request {r.request_id} has token id {max(r.prompt_token_ids)} but "
                             f"model {spec.name} has vocab_size {spec.vocab_size}")


def check_overlap_backend(probe: Scheduler, cfg: BackendConfig) -> None:
    """Overlap scheduling collects a window's ids while the next window runs, which only the
    async output path does: refuse ``scheduler.overlap`` without ``backend.async_output``."""
    if probe.overlap and not cfg.async_output:
        raise ValueError("scheduler.overlap needs backend.async_output=true: a window's ids are "
                         "collected while the next window runs")
    if probe.overlap and cfg.spec is not None:
        raise ValueError("scheduler.overlap with speculative decoding (backend.spec): the real "
                         "engine drafts from the tokens of the window before, so it runs without "
                         "overlap")


def run_real(requests: list[Request], make_scheduler: Callable[[int], Scheduler],
             model: ModelSpec, backend_cfg: Mapping[str, Any], *,
             max_concurrency: int | None = None, progress: bool = True,
             parallel: ParallelConfig | None = None, workers: Workers | None = None
             ) -> RealResult:
    """Serve ``requests`` (arrival_time: seconds after the start; all 0 = offline) on the device,
    at most ``max_concurrency`` unfinished (a held-back request's arrival_time becomes its send
    time, as common.client says); with ``parallel.tensor_parallel_size`` > 1 on that many
    ranks, this process rank 0 (real_backend/parallel.py): on ``workers`` when given (runs
    that share them skip starting processes), else on workers started for this run.

    ``make_scheduler`` is called twice: once with num_blocks=1 to read the scheduler's limits
    for profiling, then with the profiled number of KV blocks for the run itself.
    """
    cfg = BackendConfig.from_mapping(backend_cfg)
    size = _tensor_parallel_size(parallel or ParallelConfig(), model, cfg)
    clock = Clock()
    t_setup = perf_counter()
    probe = make_scheduler(1)
    check_overlap_backend(probe, cfg)
    if size > 1:
        return _run_tensor_parallel(size, requests, make_scheduler, model, cfg, probe, clock,
                                    t_setup, progress, max_concurrency, workers)
    key = repr((model, cfg, probe.config, probe.max_num_batched_tokens, runner_shape(probe)))
    kept = _KEPT.pop(key, None) if cfg.keep_runner else None
    _KEPT.clear()
    if kept:  # this run's clock and a fresh sampler; the rest is rewritten before it is read
        runner = kept  # (its allocator cache stays warm, as a fresh runner's is after warm-up)
        runner.clock = clock
        runner.generator.manual_seed(cfg.seed)
        runner.piecewise_capture_s = 0.0  # nothing captured for this run
    else:
        release_device_memory()  # what an earlier run in this process left in torch's cache
        runner = build_runner(model, cfg, probe, clock)
    ok = False
    try:
        out = _serving_loop(requests, make_scheduler, model, cfg, runner, clock, t_setup, progress,
                            max_concurrency)
        out.stats["runner_kept"] = kept is not None
        ok = True
        return out
    finally:
        if ok and cfg.keep_runner:
            _KEPT[key] = runner
        del runner
        release_device_memory()


def _tensor_parallel_size(parallel: ParallelConfig, model: ModelSpec, cfg: BackendConfig) -> int:
    """The ranks a run takes, once the settings are known to allow them."""
    if parallel.pipeline_parallel_size > 1:
        raise ValueError(f"parallel.pipeline_parallel_size={parallel.pipeline_parallel_size}: "
                         "the real engine has no pipeline parallelism (1 only)")
    parallel.check_model(model)
    size = parallel.tensor_parallel_size
    if size > 1 and cfg.keep_runner:
        raise ValueError("backend.keep_runner keeps one process's runner; with "
                         f"parallel.tensor_parallel_size {size} set it to false")
    return size


def _run_tensor_parallel(size: int, requests: list[Request],
                         make_scheduler: Callable[[int], Scheduler], model: ModelSpec,
                         cfg: BackendConfig, probe: Scheduler, clock: Clock, t_setup: float,
                         progress: bool, max_concurrency: int | None,
                         workers: Workers | None) -> RealResult:
    """The run on ``size`` ranks: the workers (started here unless given) build their shares
    beside this process's and run every window it schedules until the run's end."""
    shape = runner_shape(probe)
    if workers is not None and workers.closed:
        raise ValueError("the workers given are closed (a run on them failed)")
    if workers is not None and (workers.size, workers.device_type) != (size, cfg.torch_device.type):
        raise ValueError(f"the workers given are {workers.size} {workers.device_type} ranks, "
                         f"the run needs {size} {cfg.torch_device.type} ranks")
    release_device_memory()
    try:
        with nullcontext(workers) if workers else Workers(size, cfg) as ranks:
            ranks.group.send(BuildRunner(model, cfg, shape))
            runner = build_rank_runner(model, rank_config(cfg, 0), shape, ranks.group, clock)
            runner.publish = ranks.publish
            out = _serving_loop(requests, make_scheduler, model, cfg, runner, clock, t_setup,
                                progress, max_concurrency)
            ranks.group.send(None)  # the run's end
    except BaseException:
        if workers is not None:  # a rank may be stuck in a collective: they go too
            workers.close(clean=False)
        raise
    del runner
    release_device_memory()
    out.stats.update(runner_kept=False, tensor_parallel_size=size)
    return out


def release_kept_runner() -> None:
    """Drop the runner kept by ``backend.keep_runner`` (before building another on the device)."""
    _KEPT.clear()
    release_device_memory()


# The last run's runner (weights, KV cache, CUDA graphs), kept for the next run of the same model,
# backend settings and scheduler limits when ``backend.keep_runner``: its setup is most of a
# short run's time. A failed run's runner is never kept.
_KEPT: dict[str, ModelRunner] = {}


def release_device_memory() -> None:
    gc.collect()  # runner objects hold reference cycles (closures over the runner)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _serving_loop(requests: list[Request], make_scheduler: Callable[[int], Scheduler],
                  model: ModelSpec, cfg: BackendConfig, runner: ModelRunner, clock: Clock,
                  t_setup: float, progress: bool, max_concurrency: int | None) -> RealResult:
    sched = make_scheduler(runner.kv_cache.num_blocks)
    if sched.config.block_size != runner.block_size:
        raise ValueError("make_scheduler gave scheduler.block_size "
                         f"{sched.config.block_size}, then {runner.block_size}")
    fill_prompt_tokens(requests, model, cfg.seed)
    setup_s = perf_counter() - t_setup
    steps: list[dict[str, Any]] = []
    bar = tqdm(total=len(requests), disable=not progress, desc="serving",
               bar_format=PROGRESS_BAR_FORMAT)
    replays_before = runner.prefill_graph_replays  # the warm-up's are not the run's
    if runner.spec is not None:
        runner.spec.start_run()
    pieces_before = runner.piecewise_replays
    serve_source(ClientSource(Client(requests, max_concurrency), bar), sched, runner, clock,
                 steps)
    duration = clock()
    bar.close()
    stats = {**dataclasses.asdict(sched.stats), "setup_s": setup_s,
             "num_blocks": runner.kv_cache.num_blocks, "block_size": runner.block_size,
             "device": str(runner.device),
             "device_name": (torch.cuda.get_device_name(runner.device) if runner.cuda else "cpu"),
             "dtype": str(runner.model.dtype).removeprefix("torch."),
             "kernels": runner.kernels.name, "cuda_graph_sizes": sorted(runner.graphs.graphs),
             "prefill_graphs": len(runner.prefill_graphs.graphs),
             "prefill_graph_replays": runner.prefill_graph_replays - replays_before,
             "piecewise_graph_sizes": runner.piecewise.sizes,
             "piecewise_capture_s": runner.piecewise_capture_s,
             "piecewise_graph_replays": runner.piecewise_replays - pieces_before,
             "async_output": cfg.async_output, "weights": cfg.weights or "random",
             "cuda_module_loading": os.environ.get("CUDA_MODULE_LOADING", "default"),
             "host_cpu": host_cpu()}
    spec = runner.spec.counters if runner.spec is not None else None
    token_ids = ({r.request_id: list(r.output_token_ids) for r in requests}
                 if cfg.save_token_ids else None)
    return RealResult(duration, stats, steps, token_ids, spec)


def serve_on(runner: ModelRunner, sched: Scheduler, requests: list[Request], seed: int = 0,
             on_window: OnWindow | None = None) -> list[dict[str, Any]]:
    """Serve ``requests`` with an existing runner and scheduler (whose block manager must own the
    runner's cache); the window rows of steps.csv. The calibration measures served CPU costs
    and served step times with it, on the runner it profiles; ``on_window(batch, result,
    wall_s)`` sees each window as it ends, before update() moves its requests on."""
    fill_prompt_tokens(requests, runner.model.spec, seed)
    steps: list[dict[str, Any]] = []
    clock, saved = Clock(), runner.clock
    runner.clock = clock  # delivery times on the loop's clock

    def observed(batch: Batch, out: WindowResult, wall_s: float) -> None:
        t = perf_counter()
        on_window(batch, out, wall_s)
        clock.t0 += perf_counter() - t  # the observer's time is taken off the loop's clock

    try:
        serve_source(ClientSource(Client(requests), tqdm(disable=True)), sched, runner, clock,
                     steps, observed if on_window else None)
    finally:
        runner.clock = saved
    return steps


def serve_source(source: RequestSource, sched: Scheduler, runner: ModelRunner, clock: Clock,
                 steps: MutableSequence[dict[str, Any]],
                 on_window: OnWindow | None = None) -> None:
    """Serve what ``source`` hands over until it closes and nothing is left (offline runs, the
    calibration and the HTTP server alike), from t = 0, with everything built so far (model,
    graphs, requests) frozen out of the collector's scans: it lives for the whole run, and a
    collection during a launch-bound step then stays short. A process that froze objects of
    its own is left to its own freezing (``gc.unfreeze`` would undo every freeze, its too)."""
    ours = gc.get_freeze_count() == 0
    if ours:
        gc.collect()
        gc.freeze()
    clock.start()
    try:
        serve = _serve_overlap if sched.overlap else _serve
        serve(source, sched, runner, clock, steps, on_window)
    finally:
        if ours:
            gc.unfreeze()


def _serve(source: RequestSource, sched: Scheduler, runner: ModelRunner, clock: Clock,
           steps: MutableSequence[dict[str, Any]], on_window: OnWindow | None = None) -> None:
    """The main loop: release arrivals, schedule a window, run it, hand its tokens back."""
    while source.open or sched.has_unfinished:
        source.release(sched, clock())
        t = clock()
        batch = sched.schedule(t)
        schedule_s = clock() - t
        if batch is None:
            source.wait(sched, clock)
            continue
        out = runner.run_window(batch)
        if on_window is not None:
            on_window(batch, out, clock() - t - schedule_s)
        t_update = clock()
        source.delivered(batch, sched.update(batch, out.step_times, out.sampled), out)
        steps.append(_window_row(batch, out, t, schedule_s, clock() - t_update))


def _serve_overlap(source: RequestSource, sched: Scheduler, runner: ModelRunner, clock: Clock,
                   steps: MutableSequence[dict[str, Any]],
                   on_window: OnWindow | None = None) -> None:
    """The overlap loop: schedule window n+1 and launch it, only then wait for window n's ids
    and update() it, so the CPU's work hides behind window n+1's GPU time (formed late when
    the scheduler defers: policies/late_schedule.py)."""
    last: tuple[Batch, LaunchedWindow, float, float, float] | None = None
    late, gpu_start = LateSchedule(), 0.0  # gpu_start: when the window in flight began
    while source.open or sched.has_unfinished or last is not None:
        if last is not None and sched.defers_schedule():
            _wait_until(late.schedule_at(last[0], gpu_start), clock, runner, last[1])
        source.release(sched, clock())
        t = clock()
        batch = sched.schedule(t)
        schedule_s = clock() - t
        launched = runner.launch_window(batch, overlap=True) if batch is not None else None
        launch_wall = clock() - t - schedule_s
        if launched is not None:  # as the simulator: an empty schedule() is no formation time
            late.observe_form(schedule_s + launch_wall)
        # Taken after the launch, and the window before ends when its ids are pythonized,
        # which a layer-by-layer launch (piecewise, eager) holds up: both can come later than
        # the GPU start. Counting the whole launch in the forming time above makes up for it,
        # erring early; counting less of it left the GPU waiting in the runs measured
        # (BENCHMARKS.md, "Forming time and the window's GPU start").
        gpu_start = clock()  # the window just launched starts now, or when the last one ends
        if last is not None:
            prev, handle, t_prev, schedule_prev, wall_prev = last
            t_finish = clock()
            out = runner.finish_window(handle)
            late.observe_window(prev, sum(out.gpu_step_s))
            gpu_start = max(gpu_start, out.step_times[-1])
            if on_window is not None:
                on_window(prev, out, wall_prev + clock() - t_finish)
            t_update = clock()
            source.delivered(prev, sched.update(prev, out.step_times, out.sampled), out)
            steps.append(_window_row(prev, out, t_prev, schedule_prev, clock() - t_update))
        elif launched is None:
            source.wait(sched, clock)
        last = None if launched is None else (batch, launched, t, schedule_s, launch_wall)


POLL_S = 200e-6  # while waiting to form the next window, the window in flight's steps are
# looked at this often: a step's tokens are timed within this of its end, as a drain times them


def _wait_until(at: float | None, clock: Clock, runner: ModelRunner,
                in_flight: LaunchedWindow) -> None:
    """Wait until ``at`` (the late schedule's time to form the next window), pythonizing the
    window in flight's finished steps every ``POLL_S`` meanwhile, so that each keeps its own
    delivery time (a multi-step window's tokens would otherwise all get the time of its drain).

    The wait keeps the CPU busy, as a CUDA synchronize does while the engine without overlap
    waits for its window: it does not sleep. Sleeping between the polls, the engine ran the next
    window's schedule, input preparation and launch slower in most pairs measured, and a
    launch slower than the window's GPU work leaves the GPU waiting
    (BENCHMARKS.md, "The overlap loop's wait"). ``time.sleep(0)`` releases the GIL on every
    pass, so the process's other threads (under ``experiments.serve``, the main thread that
    watches the engine thread) are not held off."""
    next_poll = clock()
    while at is not None and (now := clock()) < at:
        if now >= next_poll:
            runner.poll_window(in_flight)
            next_poll = now + POLL_S
        time.sleep(0)


def host_cpu() -> str:
    """The host CPU's model name and the logical cores this process may run on: the CPU costs
    of a run (schedule, input preparation, launch) follow them, so a result names them beside
    the GPU."""
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), "")
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name or platform.processor() or platform.machine()} ({cores} cores)"


def _window_row(batch: Batch, out: WindowResult, t_start: float, schedule_s: float,
                update_s: float) -> dict[str, Any]:
    """steps.csv's row of a served window: the window record, the stages the simulator also
    times (its CPU before the GPU: scheduling plus preparing), then the engine's own timings."""
    record = window_record(
        batch.window_id, t_start, batch.num_steps, len(batch.seqs),
        len(batch.seqs) - batch.num_decode_seqs, out.num_tokens,
        sum(s.num_cached_tokens + s.num_query_tokens for s in batch.seqs), len(batch.preempted),
        batch.num_wasted_steps)
    return window_row(record, stage_cells(schedule_s + out.prepare_s, out.gpu_step_s),
                      schedule_s=schedule_s, prepare_s=out.prepare_s, launch_s=out.launch_s,
                      pythonize_s=out.pythonize_s, update_s=update_s)
