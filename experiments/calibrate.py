"""Calibration: microbenchmarks on the real backend, fitted into simulator hardware/overhead profiles.

    python -m experiments.calibrate                       # llama3_8b on cuda -> h200_calibrated
    python -m experiments.calibrate --data calib.csv      # refit saved measurements, no GPU

The profiling grid is made of hand-built windows (prefill chunks of many sizes, with and
without a cached prefix; decode windows of k steps over batch sizes x context lengths; mixed
batches) run through the real backend's ModelRunner, plus the CPU cost of the real Scheduler's
schedule() + update() against batch size. Windows with a prefill draw a new shape around their
nominal one for every timed repetition, as served windows never repeat one; the collector is
frozen while profiling, as it is while serving. Served runs of a synthetic workload on the same
runner add each window's CPU gap and each step's shape and time. The fit sees only these, never
the validation's runs (ShareGPT). It sets the coefficients of ``simulator.cost_model`` (a
least-squares fit of log step time) and of ``simulator.overhead`` (linear least squares),
reports each term's fit error, and writes ``conf/hardware/<name>.yaml`` and
``conf/overhead/<overhead_name>.yaml``. On a GPU with NVML it also samples the SM clock
throughout (and opens with two clock bursts), prices each step at the clock it ran at
(``--clock-elasticity``), and fits ``simulator.clock``'s power-limited clock term on the
samples.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import functools
import gc
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from experiments.files import atomic_path, write_text_atomic
from experiments.run import CONF_DIR
from policies import (
    Batch,
    ModelSpec,
    Request,
    ScheduledSeq,
    Scheduler,
    SchedulerConfig,
    make_scheduler,
)
from policies.block_manager import BlockManager
from simulator.cost_model import StepShape, step_time, window_shapes
from simulator.hardware import HardwareSpec

# (key, lower bound, upper bound): the cost-model coefficients the fit sets
FIT_KEYS = [("matmul_efficiency", 1e-7, 1.0), ("mem_bw_efficiency", 1e-7, 1.0),
            ("attn_prefill_efficiency", 1e-7, 1.0), ("attn_decode_efficiency", 1e-7, 1.0),
            ("roofline_exponent", 1.0, 64.0), ("attn_seq_gbps", 1.0, 1e5),
            ("kernel_launch_us", 0.0, 1e4), ("mixed_kernels_per_layer", 0.0, 40.0),
            ("cuda_graph_replay_us", 0.0, 1e5), ("advance_step_us", 0.0, 1e5),
            ("sampler_us", 0.0, 1e5)]
SHAPE_COLS = ["num_tokens", "num_seqs", "num_prefill_tokens", "num_sampled", "attn_pairs",
              "kv_tokens", "is_first", "max_kv_tokens"]
OPTIONAL_COLS = {"max_kv_tokens"}  # absent from older data: read as 0 (term off)
MIN_SERVED_WINDOWS = 8  # fewer served windows: the CPU costs come from the microbenchmarks
# the rows the step-time fit sees: microbenchmark windows and steps of served synthetic runs
STEP_KINDS = ["prefill", "decode", "mixed", "served_step"]


# ---------------------------------------------------------------------------- profiling grid
def grid(quick: bool, max_len: int) -> dict[str, list]:
    if quick:  # a CPU smoke grid for CI
        return {"prefill": [(1, 16, 0), (1, 64, 0), (2, 32, 0), (1, 32, 64)],
                "decode": [(1, 32, 4), (4, 64, 4), (8, 32, 1)],
                "mixed": [(4, 32, 1, 32, 0), (2, 16, 2, 8, 0)],
                "cpu": [1, 4, 8],
                "served": [("single_step", {}), ("multi_step", {"num_steps": 4})]}
    fit = lambda pts: [p for p in pts if p[1] + p[2] <= max_len - 64]  # noqa: E731
    return {
        # (num_seqs, chunk tokens each, cached prefix): nominal sizes; every timed repetition
        # draws its own within +-12.5% (small prefill-only windows replay CUDA graphs; the rest
        # run eagerly)
        "prefill": fit([(1, t, 0) for t in (16, 64, 128, 200, 256, 400, 512, 600, 768, 1024,
                                            2048, 4096, 6000, 8000)]
                       + [(2, 100, 0), (3, 150, 0), (4, 60, 0), (8, 50, 0), (2, 250, 0)]
                       + [(4, 256, 0), (8, 512, 0), (16, 128, 0), (32, 64, 0), (2, 1024, 0)]
                       + [(2, 3500, 0), (4, 1800, 0), (8, 900, 0), (24, 300, 0)]
                       + [(1, 512, 512), (1, 512, 2048), (1, 2048, 2048), (4, 512, 1024)]),
        # (batch size, context length, k)
        "decode": [(b, c, 4) for b in (1, 8, 32, 64, 128, 256) for c in (128, 512, 1024, 2048)]
                  + [(b, 512, 1) for b in (1, 8, 16, 64, 96, 200, 256)]
                  + [(256, 512, 8), (64, 1024, 16)]
                  # ragged contexts (0: drawn from 32..2000 per sequence), as served batches are
                  + [(b, 0, 4) for b in (32, 128, 192, 256)] + [(256, 0, 8)]
                  # skewed contexts (-1: 32 + Exp(400), capped at 2000)
                  + [(b, -1, 4) for b in (16, 48, 64, 96, 160, 256)],
        # (decodes, their context, prompts, chunk tokens each, the chunks' cached prefix)
        "mixed": [(32, 512, 1, 512, 0), (128, 512, 1, 256, 0), (128, 512, 1, 1536, 0),
                  (256, 512, 1, 1024, 0), (64, 1024, 1, 512, 1024), (200, 256, 1, 2048, 0),
                  (8, 512, 1, 64, 0), (32, 300, 1, 128, 0), (64, 500, 1, 200, 0),
                  (16, 800, 1, 500, 0), (240, 500, 4, 300, 0), (160, 400, 2, 900, 0),
                  (250, 300, 8, 400, 0), (100, 600, 3, 150, 0)],
        "cpu": [1, 8, 32, 64, 128, 256],
        # served windows of a synthetic workload: the CPU costs (policy, its settings)
        "served": [("single_step", {}), ("multi_step", {"num_steps": 8}),
                   ("chunked_prefill", {})],
    }


class Profiler:
    """Runs hand-built windows on a ModelRunner and records each step's shape and time."""

    def __init__(self, spec: ModelSpec, backend: dict[str, Any], reps: int,
                 scatter: bool = True, sustain_s: float = 0.0) -> None:
        import torch

        from real_backend.config import BackendConfig
        from real_backend.engine import build_runner, release_kept_runner

        self.torch = torch
        self.spec = spec
        self.cfg = BackendConfig.from_mapping(backend)
        graphs = self.cfg.use_cuda_graphs
        self.prefill_graph_max_tokens = self.cfg.prefill_graph_max_tokens if graphs else 0
        self.piecewise_graph_max_tokens = self.cfg.piecewise_graph_max_tokens if graphs else 0
        probe = make_scheduler("multi_step", {"num_steps": 16},
                               SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192), 1,
                               spec.max_model_len)
        release_kept_runner()  # a kept runner of earlier runs would hold the device's memory
        self.runner = build_runner(spec, self.cfg, probe)
        self.cuda = self.runner.device.type == "cuda"
        kv = self.runner.kv_cache
        for t in kv.k + kv.v:  # not zeros: real-looking data in every block that is read
            t.normal_(0.0, 0.5)
        self.blocks = BlockManager(kv.num_blocks, self.runner.block_size, 0.0)
        if scatter:  # served block tables are scattered over the cache, not contiguous
            self.blocks.shuffle_free(0)
        self.rng = np.random.default_rng(0)
        self.max_len = spec.max_model_len - 64
        self.next_id = 0
        self.reps = reps
        self.sustain_s = sustain_s
        self.rows: list[dict[str, Any]] = []
        # every window run, timed or not: (window id, wall start, wall end, GPU seconds), so
        # that the GPU's load history can be replayed against its sampled clock
        self.timeline: list[tuple[int, float, float, float]] = []
        self.timed: dict[int, list[tuple[float, float]]] = {}  # window id -> timed intervals
        self.window_id = 0
        # run before each repetition of a window with a prefill, as a served run orders them
        self.between = Batch([self.decode_seq(-1 - i, 100, 1) for i in range(8)], 1)
        self._record_shapes("between", self.between, 0, [], [0.0], [0.0])  # never timed

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def drawn(self, q: int, cached: int) -> tuple[int, int]:
        """A chunk and cached prefix drawn within +-12.5% of the nominal ones (as served, where
        no two eager windows have the same shape), kept inside the model's context."""
        q = max(1, round(q * self.rng.uniform(0.875, 1.125)))
        cached = round(cached * self.rng.uniform(0.875, 1.125))
        return min(q, self.max_len), max(0, min(cached, self.max_len - q))

    def _request(self, rid: int, prompt: int) -> Request:
        ids = self.rng.integers(0, self.spec.vocab_size, prompt).tolist()
        return Request(rid, 0.0, prompt, 1 << 20, prompt_token_ids=ids)

    def prefill_seq(self, rid: int, q: int, cached: int) -> ScheduledSeq:
        req = self._request(rid, q + cached)
        req.num_computed_tokens = cached
        if not self.blocks.ensure_slots(req, q + cached):
            raise ValueError("calibration: the KV cache is too small for the profiling grid")
        return ScheduledSeq(req, q, cached, 1, True)

    def decode_seq(self, rid: int, ctx: int, k: int) -> ScheduledSeq:
        req = self._request(rid, ctx)
        req.output_token_ids.append(int(self.rng.integers(0, self.spec.vocab_size)))
        req.num_output_tokens = 1
        req.num_computed_tokens = ctx
        if not self.blocks.ensure_slots(req, ctx + k):
            raise ValueError("calibration: the KV cache is too small for the profiling grid")
        return ScheduledSeq(req, 1, ctx, k, False)

    def _run(self, wid: int, batch: Batch, timed: bool = False):
        t0 = time.perf_counter()
        out = self.runner.run_window(batch)
        t1 = time.perf_counter()
        self._log(wid, t0, t1, sum(out.gpu_step_s), timed)
        return out, t1 - t0

    def _log(self, wid: int, t0: float, t1: float, gpu_s: float, timed: bool) -> None:
        """A window run from t0 to t1 with gpu_s of GPU work: on the timeline, and if timed,
        its GPU span (which ended at t1) for the clock samples."""
        self.timeline.append((wid, t0, t1, gpu_s))
        if timed:
            self.timed.setdefault(wid, []).append((t1 - gpu_s, t1))

    def _step_times(self, out, wall: float, k: int) -> list[float]:
        """A window's step times: CUDA events on the GPU; on the CPU, where kernels run
        synchronously, its wall time less input preparation, shared evenly by its k steps."""
        return out.gpu_step_s if self.cuda else [(wall - out.prepare_s) / k] * k

    def _record_shapes(self, kind: str, batch: Batch, wid: int, per_step: list,
                       prepare: list[float], pythonize: list[float]) -> None:
        k = batch.num_steps
        for j, shape in enumerate(window_shapes(batch)):
            self.rows.append({"kind": kind, "k": k, "step": j, "window": wid,
                              **{c: getattr(shape, c) for c in SHAPE_COLS},
                              "prefill_graph_max_tokens": self.prefill_graph_max_tokens,
                              "piecewise_graph_max_tokens": self.piecewise_graph_max_tokens,
                              "gpu_s": statistics.median(r[j] for r in per_step)
                              if per_step else math.nan,
                              "prepare_s": statistics.median(prepare) if j == 0 else math.nan,
                              "pythonize_s": statistics.median(pythonize) / k})

    def _sustain(self, wid: int, batch: Batch) -> None:
        """Warm-up (graph and kernel selection), then the window back to back for
        ``sustain_s``: a served run keeps the GPU busy, and under sustained load it settles at
        lower clocks (power limit) than in short bursts."""
        self._run(wid, batch)
        t_end = time.perf_counter() + self.sustain_s
        while time.perf_counter() < t_end:
            self._run(wid, batch)

    def _timed(self, wid: int, batch: Batch, after_decode: bool):
        """One timed run from an idle GPU; ``after_decode``: right after a decode window, as a
        served prefill follows decode steps. Returns the window's result and wall seconds."""
        if after_decode:
            self._run(0, self.between)
        if self.cuda:
            self.torch.cuda.synchronize()
        return self._run(wid, batch, timed=True)

    def measure(self, kind: str, seqs: list[ScheduledSeq], k: int) -> None:
        batch = Batch(seqs, k)
        self.window_id += 1
        wid = self.window_id
        self._sustain(wid, batch)
        per_step, prepare, pythonize = [], [], []
        for _ in range(self.reps):
            out, wall = self._timed(wid, batch, after_decode=kind != "decode")
            gpu = self._step_times(out, wall, k)
            per_step.append(gpu)
            prepare.append(out.prepare_s)
            pythonize.append(out.pythonize_s)
        self.free(seqs)
        self._record_shapes(kind, batch, wid, per_step, prepare, pythonize)

    def measure_fresh(self, kind: str, make: Callable[[bool], list[ScheduledSeq]]) -> None:
        """A one-step eager window as served: ``make(True)`` draws new requests of a new shape
        for every timed repetition, each recorded as its own window. Launch-bound steps pay host
        work per new shape (GEMM selection, allocator, launch paths) that repeating one shape
        hides; compute-bound ones meet odd GEMM sizes. ``make(False)`` is the nominal window
        that first runs back to back (``sustain_s``) to bring the GPU to its loaded state."""
        nominal = make(False)
        batch = Batch(nominal, 1)
        self.window_id += 1
        self._record_shapes("sustain", batch, self.window_id, [], [0.0], [0.0])  # never timed
        self._sustain(self.window_id, batch)
        self.free(nominal)
        for _ in range(self.reps):
            seqs = make(True)
            batch = Batch(seqs, 1)
            self.window_id += 1
            out, wall = self._timed(self.window_id, batch, after_decode=True)
            gpu = self._step_times(out, wall, 1)
            self.free(seqs)
            self._record_shapes(kind, batch, self.window_id, [gpu], [out.prepare_s],
                                [out.pythonize_s])

    def served(self, policy: str, params: dict[str, Any], num_prompts: int,
               quick: bool) -> None:
        """The serving loop on this runner over a synthetic workload (lognormal lengths, all at
        t=0; never the validation's ShareGPT), for the costs that only serving shows.

        CPU: one ``served`` row per window: the time it adds beyond its GPU work (to the next
        window's start: schedule, input preparation, the launch the GPU waits for, the drain,
        update), its timed CPU parts, and pythonization per step. Hand-built microbenchmark
        windows measure preparation up to 0.3 ms dearer than served ones at small batches.
        GPU: one ``served_step`` row per step, its shape and time (with the clock it ran at),
        for the step-time fit beside the microbenchmarks (a fit on isolated windows alone
        priced served large decode batches and multi-prompt prefills 2-11% fast).
        """
        from real_backend.engine import serve_on

        cap_p, cap_o = (40, 12) if quick else (2000, 1000)
        prompts = np.clip(np.round(self.rng.lognormal(np.log(180), 0.9, num_prompts)), 2, cap_p)
        outputs = np.clip(np.round(self.rng.lognormal(np.log(120), 0.9, num_prompts)), 2, cap_o)
        reqs = [Request(self.new_id(), 0.0, int(p), int(o)) for p, o in zip(prompts, outputs,
                                                                          strict=True)]

        def scheduler(budget: int | None) -> Scheduler:
            return make_scheduler(policy, params, SchedulerConfig(
                max_num_seqs=256, max_num_batched_tokens=budget,
                block_size=self.runner.block_size), self.blocks.num_blocks,
                self.spec.max_model_len)

        sched = scheduler(None)  # the policy's own token budget, within the profiled 8192
        if sched.max_num_batched_tokens > 8192:
            sched = scheduler(8192)

        def on_window(batch: Batch, out, wall_s: float) -> None:
            t1 = time.perf_counter()  # the window's GPU work has drained
            gpu = self._step_times(out, wall_s, batch.num_steps)
            self.window_id += 1
            self._log(self.window_id, t1 - wall_s, t1, sum(gpu), timed=True)
            first = len(self.rows)
            self._record_shapes("served_step", batch, self.window_id, [gpu], [out.prepare_s],
                                [out.pythonize_s])
            for row in self.rows[first:]:  # (served_window: the served row of its CPU costs)
                row.update(policy=policy, served_window=batch.window_id)

        windows = serve_on(self.runner, sched, reqs, seed=self.next_id, on_window=on_window)
        for w, nxt in zip(windows, windows[1:]):
            self.rows.append({"kind": "served", "k": w["k"], "step": 0, "policy": policy,
                              "served_window": w["window"],
                              "num_seqs": w["num_seqs"], "num_tokens": w["num_tokens"],
                              "kv_tokens": w["kv_tokens"], "prepare_s": w["prepare_s"],
                              "launch_s": w["launch_s"], "gpu_s": w["gpu_s"],
                              "cpu_s": w["schedule_s"] + w["prepare_s"] + w["update_s"],
                              # the time the window adds beyond its GPU work (0 on the CPU)
                              "gap_s": max(nxt["t_start"] - w["t_start"] - w["gpu_s"], 0.0)
                              if self.cuda else math.nan,
                              "pythonize_s": w["pythonize_s"] / w["k"]})

    def free(self, seqs: list[ScheduledSeq]) -> None:
        for s in seqs:
            self.blocks.free(s.request)

    def burst(self, kind: str, seqs: list[ScheduledSeq], k: int, seconds: float,
              gaps: tuple[float, ...] = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 4.0)) -> None:
        """One window back to back for ``seconds`` from a rested GPU, then alone after growing
        idle gaps: how the clock falls under sustained load and recovers (the heat fit's data)."""
        batch = Batch(seqs, k)
        self.window_id += 1
        wid = self.window_id
        self._run(wid, batch)
        time.sleep(max(gaps))
        per_step = []
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            per_step.append(self._run(wid, batch, timed=True)[0].gpu_step_s)
        for gap in gaps:
            time.sleep(gap)
            self._run(wid, batch, timed=True)
        self.free(seqs)
        self._record_shapes(kind, batch, wid, per_step, [0.0], [0.0])

    def cpu_scheduler(self, num_seqs: int, k: int, windows: int = 50) -> None:
        """schedule() + update() of the real Scheduler with num_seqs decoding requests."""
        s = decoding_scheduler(num_seqs, k)
        costs = []
        now = 0.0
        for _ in range(windows):
            t0 = time.perf_counter()
            b = s.schedule(now)
            s.update(b, [now + j for j in range(b.num_steps)])
            costs.append(time.perf_counter() - t0)
            now += k
        self.rows.append({"kind": "scheduler", "k": k, "step": 0, "num_seqs": num_seqs,
                          "num_tokens": num_seqs, "sched_s": statistics.median(costs)})


def decoding_scheduler(num_seqs: int, k: int) -> Scheduler:
    """A real multi_step k Scheduler whose num_seqs requests are all admitted and decoding (an
    unbounded KV cache): its schedule() + update() is the serving loop's CPU work per window."""
    s = make_scheduler("multi_step", {"num_steps": k}, SchedulerConfig(
        max_num_seqs=max(num_seqs, 1), max_num_batched_tokens=1 << 20), 1 << 20, 1 << 20)
    for i in range(num_seqs):
        s.add_request(Request(i, 0.0, 256, 1 << 19))
    while s.num_waiting:
        b = s.schedule(0.0)
        s.update(b, [0.0] * b.num_steps)
    return s


def _prefill_window(p: Profiler, n: int, q: int, cached: int,
                    drawn: bool) -> list[ScheduledSeq]:
    """n prompts of q new tokens over a cached prefix (each drawn anew when ``drawn``)."""
    return [p.prefill_seq(p.new_id(), *(p.drawn(q, cached) if drawn else (q, cached)))
            for _ in range(n)]


def _mixed_window(p: Profiler, decodes: int, ctx: int, n: int, q: int, cached: int,
                  drawn: bool) -> list[ScheduledSeq]:
    """``decodes`` sequences decoding at context ``ctx`` beside n prefill chunks."""
    if drawn:
        decodes = max(1, round(decodes * p.rng.uniform(0.875, 1.125)))
    return ([p.decode_seq(p.new_id(), ctx, 1) for _ in range(decodes)]
            + _prefill_window(p, n, q, cached, drawn))


@dataclasses.dataclass
class Profile:
    """What a profiling pass measured: one row per step of every window (``data``), every window
    run in order (``timeline``: window id, wall start and end, GPU seconds), and the GPU's
    sampled clock (``clock``; empty where NVML is not available). Times share one origin."""

    data: pd.DataFrame
    timeline: pd.DataFrame
    clock: pd.DataFrame


def profile(spec: ModelSpec, backend: dict[str, Any], quick: bool, reps: int,
            progress: bool = True, sustain_s: float = 0.0, burst_s: float = 0.0) -> Profile:
    from tqdm import tqdm

    p = Profiler(spec, backend, reps, sustain_s=sustain_s)
    sampler = None
    if p.cuda:
        from real_backend.gpu_clock import ClockSampler

        sampler = ClockSampler.for_device(p.runner.device.index or 0)
        if sampler is not None:
            sampler.start()
    if sampler is None:
        burst_s = 0.0  # the bursts are for the clock fit: without samples they tell nothing
    g = grid(quick, spec.max_model_len)
    total = sum(len(v) for v in g.values()) + (2 if burst_s else 0)
    t_origin = time.perf_counter()
    # As the serving loop does: what exists before the timed work is frozen out of the
    # collector, so a full collection cannot land in a timed window.
    gc.collect()
    gc.freeze()
    try:
        with tqdm(total=total, desc="calibrating", disable=not progress) as bar:
            if burst_s:  # first, from a GPU rested by the idle start: the clock's fall and recovery
                time.sleep(5.0)
                p.burst("burst_prefill", [p.prefill_seq(p.new_id(), 1024, 0) for _ in range(4)], 1,
                        burst_s)
                p.burst("burst_decode", [p.decode_seq(p.new_id(), 500, 8) for _ in range(256)], 8,
                        burst_s / 2)
                bar.update(2)
            for n, q, cached in g["prefill"]:
                p.measure_fresh("prefill", functools.partial(_prefill_window, p, n, q, cached))
                bar.update()
            for b, ctx, k in g["decode"]:
                if ctx == -1:  # skewed as served: mostly short, a few long
                    ctxs = [int(c) for c in np.minimum(32 + p.rng.exponential(400, b), 2000)]
                else:
                    ctxs = [ctx or int(c) for c in p.rng.integers(32, 2000, b)]
                p.measure("decode", [p.decode_seq(p.new_id(), c, k) for c in ctxs], k)
                bar.update()
            for b, ctx, n, q, cached in g["mixed"]:
                p.measure_fresh("mixed", functools.partial(_mixed_window, p, b, ctx, n, q, cached))
                bar.update()
            for n in g["cpu"]:
                for k in (1, 8):
                    p.cpu_scheduler(n, k)
                bar.update()
            for policy, params in g["served"]:
                p.served(policy, params, 12 if quick else 400, quick)
                bar.update()
    finally:
        gc.unfreeze()
    data = pd.DataFrame(p.rows)
    timeline = pd.DataFrame(p.timeline, columns=["window", "start_s", "end_s", "gpu_s"])
    timeline[["start_s", "end_s"]] -= t_origin
    clock = pd.DataFrame(columns=["t", "sm_mhz", "power_w", "temp_c"])
    if sampler is not None:
        sampler.stop()
        clock = sampler.frame()
        clock["t"] -= t_origin
        # each window's clock: the mean of the samples taken while its timed runs were on the GPU
        # (short windows may fall between two samples: then the samples nearest to them)
        mhz = {}
        ct = clock["t"].to_numpy()
        for wid, spans in p.timed.items():
            picked = []
            for t0, t1 in spans:
                t0, t1 = t0 - t_origin - 0.005, t1 - t_origin + 0.005
                inside = np.flatnonzero((ct >= t0) & (ct <= t1))
                if len(inside):
                    picked.extend(inside)
                elif len(ct):
                    picked.append(int(np.argmin(np.abs(ct - (t0 + t1) / 2))))
            if picked:
                mhz[wid] = float(clock["sm_mhz"].to_numpy()[picked].mean())
        data["sm_mhz"] = data["window"].map(mhz)
        data["max_sm_mhz"] = float(sampler.max_sm_mhz)
    return Profile(data, timeline, clock)


# ---------------------------------------------------------------------------- fitting
def _shape(row: pd.Series) -> StepShape:
    longest = getattr(row, "max_kv_tokens", 0)
    return StepShape(int(row.num_tokens), int(row.num_seqs), int(row.num_prefill_tokens),
                     int(row.num_sampled), float(row.attn_pairs), int(row.kv_tokens),
                     bool(row.is_first), 0 if pd.isna(longest) else int(longest))


def _slowdowns(rows: pd.DataFrame) -> np.ndarray:
    """Each row's measured clock slowdown (max SM clock / its clock); 1 where not sampled."""
    if "sm_mhz" not in rows or "max_sm_mhz" not in rows:
        return np.ones(len(rows))
    slow = (rows["max_sm_mhz"] / rows["sm_mhz"]).to_numpy(dtype=float)
    return np.where(np.isfinite(slow) & (slow > 0), slow, 1.0)


def fit_gpu(data: pd.DataFrame, spec: ModelSpec, base: HardwareSpec,
            elasticity: float | None = 1.0) -> tuple[HardwareSpec, pd.DataFrame, float]:
    """Least squares on log step time over the cost model's coefficients (bounded). Where the
    data has each window's sampled SM clock, a step is priced at slowdown 1 + elasticity *
    (max clock / its clock - 1) of its compute-bound terms; ``elasticity`` None fits it with
    the rest (0: the sampled clock explains nothing; 1: fully). Returns the elasticity used
    (0 where no clock was sampled)."""
    from scipy.optimize import least_squares

    steps = data[data["kind"].isin(STEP_KINDS)].reset_index(drop=True)
    shapes = [_shape(r) for r in steps.itertuples()]
    slows = _slowdowns(steps)
    measured = steps["gpu_s"].to_numpy()
    if len(shapes) < len(FIT_KEYS) or not np.all(measured > 0):
        raise ValueError("calibration data: need positive step times for at least "
                         f"{len(FIT_KEYS)} steps, got {len(shapes)}")
    base_d = {f: getattr(base, f) for f in base.__dataclass_fields__}
    keys = FIT_KEYS
    if not any(s.max_kv_tokens for s in shapes):  # older data: no longest-sequence term
        keys = [k for k in FIT_KEYS if k[0] != "attn_seq_gbps"]
        base_d["attn_seq_gbps"] = 0.0
    elif not base_d["attn_seq_gbps"]:
        base_d["attn_seq_gbps"] = 200.0  # a start for the fit
    if not base_d["roofline_exponent"]:
        base_d["roofline_exponent"] = 4.0  # a start for the fit (0, the plain max, is its limit)

    def spec_of(x: np.ndarray) -> HardwareSpec:
        return HardwareSpec(**{**base_d, **{k: float(v) for (k, _, _), v in zip(keys, x, strict=True)}})

    clocked = bool(np.any(slows != 1.0))

    def predict(hw: HardwareSpec, elasticity: float) -> np.ndarray:
        return np.array([step_time(s, spec, hw, 1.0 + elasticity * (w - 1.0))
                         for s, w in zip(shapes, slows, strict=True)])

    free = clocked and elasticity is None  # fitted with the rest
    if not clocked:
        elasticity = 0.0

    def resid(x: np.ndarray) -> np.ndarray:
        e = x[-1] if free else elasticity
        return np.log(np.maximum(predict(spec_of(x[:len(keys)]), e), 1e-12)) - np.log(measured)

    bounds = keys + ([("clock_elasticity", 0.0, 1.5)] if free else [])
    lo = np.array([b[1] for b in bounds])
    hi = np.array([b[2] for b in bounds])
    x0 = np.clip(np.array([base_d[k] for k, _, _ in keys] + ([1.0] if free else []),
                          dtype=float), lo + 1e-9, hi)
    x = least_squares(resid, x0, bounds=(lo, hi), x_scale="jac", max_nfev=4000).x
    hw = spec_of(x[:len(keys)])
    if free:
        elasticity = float(x[-1])
    steps = steps.assign(predicted_s=predict(hw, elasticity))
    steps["rel_error"] = steps["predicted_s"] / steps["gpu_s"] - 1
    return hw, steps, elasticity


def fit_clock(data: pd.DataFrame, timeline: pd.DataFrame, clock: pd.DataFrame,
              spec: ModelSpec, hw: HardwareSpec,
              elasticity: float = 1.0) -> tuple[HardwareSpec, dict[str, float]]:
    """Fit ``simulator.clock``'s power and heat slowdowns and its time constant on the clock
    samples taken while the GPU ran the profiled windows: the load history (every window run,
    at its tensor-core share under the fitted cost model) is replayed through the heat model,
    and the slowdowns solve a non-negative least squares for each time constant on a grid.
    They are then scaled by ``elasticity`` (``fit_gpu``): the share of the clock's slowdown
    that shows in step times."""
    from simulator.clock import PowerClock
    from simulator.cost_model import step_cost

    if clock.empty or timeline.empty or "max_sm_mhz" not in data:
        return hw, {}
    share = {}  # window id -> tensor-core share of its GPU time at full clock
    for wid, rows in data.groupby("window"):
        busy = total = 0.0
        for r in rows.itertuples():
            t, b = step_cost(_shape(r), spec, hw)
            busy, total = busy + b, total + t
        share[wid] = busy / total if total > 0 else 0.0
    tl = timeline.sort_values("end_s")
    starts = (tl["end_s"] - tl["gpu_s"]).to_numpy()
    ends = tl["end_s"].to_numpy()
    us = tl["window"].map(share).fillna(0.0).to_numpy()
    samples = clock.sort_values("t")
    ts = samples["t"].to_numpy()
    slow = float(data["max_sm_mhz"].iloc[0]) / samples["sm_mhz"].to_numpy(dtype=float)
    # the samples taken while a window ran (idle clocks say nothing about loaded ones)
    idx = np.searchsorted(ends, ts)
    on = (idx < len(ends)) & (ts >= starts[np.minimum(idx, len(ends) - 1)])
    on &= slow < 2.0  # not a clock still ramping up from idle
    if on.sum() < 20:
        return hw, {}
    best = None
    for tau in np.geomspace(0.1, 300.0, 60):
        pc = PowerClock(spec, dataclasses.replace(hw, clock_tau_s=float(tau)))
        heat = np.empty(len(ts))
        j = 0
        for s0, e0, u in zip(starts, ends, us, strict=True):
            pc.rest_until(s0)
            while j < len(ts) and ts[j] < e0:  # samples up to this window's end
                if ts[j] >= s0:
                    pc.run(u, ts[j] - pc.t)
                else:
                    pc.rest_until(ts[j])
                heat[j] = pc.heat
                j += 1
            pc.run(u, e0 - pc.t)
        heat[j:] = pc.heat
        X = np.column_stack([us[np.minimum(idx, len(us) - 1)], heat])[on]
        coef = _nnls(X, slow[on] - 1.0)
        err = float(np.sqrt(np.mean((X @ coef - (slow[on] - 1.0)) ** 2)))
        if best is None or err < best[0]:
            best = (err, float(tau), coef)
    err, tau, (beta_fit, alpha_fit) = best
    beta, alpha = (x * elasticity if x * elasticity > 1e-9 else 0.0 for x in (beta_fit, alpha_fit))
    hw = dataclasses.replace(hw, clock_power_slowdown=float(f"{beta:.4g}"),
                             clock_heat_slowdown=float(f"{alpha:.4g}"), clock_tau_s=float(f"{tau:.4g}"))
    return hw, {"clock slowdown rms": err, "samples": float(on.sum()),
                "clock power slowdown": float(beta_fit), "clock heat slowdown": float(alpha_fit),
                "elasticity": elasticity}


def fit_overhead(data: pd.DataFrame, name: str) -> tuple[dict[str, Any], dict[str, float]]:
    """Per invocation, a + b*num_seqs + c*num_tokens + d*kv_tokens, plus m + n*num_seqs*(k - 1) in
    windows of k > 1 steps; per step, e + f*num_seqs.

    With served rows (``Profiler.served``): the window term is the CPU gap a served window
    costs (schedule + input preparation + update), the step term its pythonization. Older data
    without them: schedule + update from the Scheduler bench (k=1) plus the microbenchmarks'
    input preparation per window, and pythonization plus update()'s per-step share per step.
    """
    served = data[data["kind"] == "served"]
    from_served = len(served) >= MIN_SERVED_WINDOWS

    def window_features(rows: pd.DataFrame) -> np.ndarray:
        k = rows["k"].to_numpy(dtype=float)
        return np.column_stack([np.ones(len(rows)), rows["num_seqs"], rows["num_tokens"],
                                rows["kv_tokens"], (k > 1).astype(float),
                                rows["num_seqs"] * (k - 1)])

    if from_served:
        # the GPU's idle time between served windows (schedule, preparation, the launch the
        # GPU waits for, the drain, update) less the last step's pythonization, which the
        # per-step term prices (earlier steps' overlap the GPU); data without it (and the CPU):
        # the timed CPU parts
        gap = served.get("gap_s", pd.Series(np.nan, index=served.index))
        y = np.where(gap.notna(), gap - served["pythonize_s"], served["cpu_s"])
        X = window_features(served)
        out_rows = served
    else:
        sched = data[data["kind"] == "scheduler"]
        # schedule()+update() per window, as a function of num_seqs (k=1 rows: one token each)
        s1 = sched[sched["k"] == 1]
        sb = np.polyfit(s1["num_seqs"], s1["sched_s"], 1) if len(s1) >= 2 else np.zeros(2)
        steps = data[data["kind"].isin(["prefill", "decode", "mixed"]) & (data["step"] == 0)]
        X = window_features(steps)
        y = steps["prepare_s"].to_numpy() + np.polyval(sb, steps["num_seqs"].to_numpy())
        out_rows = data[data["kind"].isin(["decode"])]
    coef = _nnls(X, y)
    Xo = np.column_stack([np.ones(len(out_rows)), out_rows["num_seqs"]])
    coef_o = _nnls(Xo, out_rows["pythonize_s"].to_numpy())
    coef_py = coef_o.copy()  # the pythonization fit alone, for its error
    if not from_served:
        # update() appends every step's token to every request: the part of the scheduler's
        # cost that grows with k is per step and per sequence, so it joins the per-step cost
        by_k = {k: sched[sched["k"] == k].set_index("num_seqs")["sched_s"] for k in (1, 8)}
        both = by_k[1].index.intersection(by_k[8].index)
        if len(both) >= 2:
            extra = (by_k[8][both] - by_k[1][both]) / 7  # per extra step
            coef_o[1] += max(float(np.polyfit(both.to_numpy(), extra.to_numpy(), 1)[0]), 0.0)
    prof = {"name": name,
            "schedule_base_us": round(float(coef[0]) * 1e6, 3),
            "schedule_per_seq_us": round(float(coef[1]) * 1e6, 4),
            "schedule_per_token_us": round(float(coef[2]) * 1e6, 5),
            "schedule_per_kv_token_us": round(float(coef[3]) * 1e6, 6),
            "schedule_multi_step_us": round(float(coef[4]) * 1e6, 3),
            "schedule_multi_step_per_seq_us": round(float(coef[5]) * 1e6, 4),
            "output_base_us": round(float(coef_o[0]) * 1e6, 3),
            "output_per_seq_us": round(float(coef_o[1]) * 1e6, 4),
            "api_per_token_us": 0.0,  # schedlab's engine has no API server
            "async_output_processing": True,
            "defer_last_output": False,  # the engine drains a window's outputs as it ends
            "api_server_on_critical_path": True}
    err = {"schedule_and_prepare": _median_abs_rel(X @ coef, y),
           "output_processing": _median_abs_rel(Xo @ coef_py, out_rows["pythonize_s"].to_numpy())}
    return prof, err


def _elasticity(value: str) -> float | None:
    """--clock-elasticity: 'fit' (None) or a number >= 0."""
    if value == "fit":
        return None
    try:
        x = float(value)
    except ValueError:
        x = math.nan
    if not (math.isfinite(x) and x >= 0):
        raise argparse.ArgumentTypeError(f"expected 'fit' or a finite number >= 0, got {value!r}")
    return x


def _nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    from scipy.optimize import nnls

    return nnls(X, y)[0]


def _median_abs_rel(pred: np.ndarray, meas: np.ndarray) -> float:
    ok = meas > 0
    return float(np.median(np.abs(pred[ok] / meas[ok] - 1))) if ok.any() else math.nan


def term_errors(steps: pd.DataFrame) -> pd.DataFrame:
    """Fit error per term group: the rows where that term dominates the step."""
    groups = {
        "linear + prefill attention (prefill steps)": steps["kind"] == "prefill",
        "decode, KV reads, CUDA graph (decode step 1)": (steps["kind"] == "decode") & (steps["step"] == 0),
        "advance_step (decode steps 2..k)": (steps["kind"] == "decode") & (steps["step"] > 0),
        "mixed prefill + decode": steps["kind"] == "mixed",
        "served steps, synthetic workloads": steps["kind"] == "served_step",
    }
    rows = []
    for term, mask in groups.items():
        e = steps.loc[mask, "rel_error"].abs()
        if len(e):
            rows.append({"term": term, "points": len(e), "median_abs_rel_error": e.median(),
                         "max_abs_rel_error": e.max()})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------- outputs
def _companion(data_csv: Path, part: str) -> Path:
    """Where a calibration CSV's window timeline or clock samples are kept: X.csv -> X.part.csv."""
    return data_csv.with_name(f"{data_csv.stem}.{part}.csv")


def write_yaml(path: Path, data: dict[str, Any], header: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    comment = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    write_text_atomic(path, comment + yaml.safe_dump(data, sort_keys=False))


def load_conf(group: str, name_or_path: str, conf_dir: str = CONF_DIR) -> dict[str, Any]:
    path = Path(name_or_path)
    if not path.suffix:
        path = Path(conf_dir) / group / f"{name_or_path}.yaml"
    if not path.exists():
        raise ValueError(f"{group} profile {name_or_path!r} not found ({path})")
    return yaml.safe_load(path.read_text())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3_8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--num-blocks", type=int, default=None, help="KV blocks (required on cpu)")
    ap.add_argument("--base-hardware", default=None,
                    help="profile whose datasheet numbers are kept (default h200; cpu on cpu)")
    ap.add_argument("--name", default="h200_calibrated", help="name of the hardware profile written")
    ap.add_argument("--overhead-name", default="schedlab_h200", help="name of the overhead profile")
    ap.add_argument("--conf-dir", default=CONF_DIR, help="where hardware/ and overhead/ go")
    ap.add_argument("--data", default=None, help="refit saved measurements (CSV), no profiling")
    ap.add_argument("--save-data", default=None, help="CSV for the measurements (default: conf "
                    "dir's calibration/<name>.csv)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sustain", type=float, default=None, help="seconds each window runs back "
                    "to back before it is timed (default 0.4 on cuda, 0 on cpu)")
    ap.add_argument("--burst", type=float, default=None, help="seconds of the clock bursts "
                    "(default 10 on cuda, 0: none)")
    ap.add_argument("--quick", action="store_true", help="a tiny grid (CPU smoke test)")
    ap.add_argument("--clock-elasticity", type=_elasticity, default=1.0,
                    help="how much of the sampled clock's slowdown shows in compute-bound "
                    "step times: a number (default 1: step time scales with the clock) or 'fit'. Fitting it was unstable on H200 data (0, "
                    "0.96, 0.06 in three calibrations): the profiled clocks vary too little to "
                    "tell it from matmul efficiency, and a served step's clock is one or two "
                    "samples, noise that pulls a fitted coefficient towards 0")
    args = ap.parse_args(argv)
    try:
        spec = ModelSpec.from_dict(load_conf("model", args.model))
        base_name = args.base_hardware or ("cpu" if args.device == "cpu" else "h200")
        base = HardwareSpec.from_dict(load_conf("hardware", base_name))
        if args.data:
            data = pd.read_csv(args.data)
            missing = ({"kind", "k", "step", "gpu_s", *SHAPE_COLS} - OPTIONAL_COLS
                       - set(data.columns))
            if missing:
                raise ValueError(f"--data {args.data}: not calibration data (missing "
                                 f"{', '.join(sorted(missing))})")
        else:
            backend = {"device": args.device, "num_blocks": args.num_blocks}
            sustain = args.sustain if args.sustain is not None else (
                0.4 if args.device.startswith("cuda") else 0.0)
            burst = args.burst if args.burst is not None else (
                10.0 if args.device.startswith("cuda") else 0.0)
            prof = profile(spec, backend, args.quick, args.reps, sustain_s=sustain, burst_s=burst)
            data = prof.data
        save = Path(args.save_data or args.data or
                    Path(args.conf_dir) / "calibration" / f"{args.name}.csv")
        save.parent.mkdir(parents=True, exist_ok=True)
        if not args.data:
            with atomic_path(save) as tmp:
                data.to_csv(tmp, index=False)
            for part in ("timeline", "clock"):
                with atomic_path(_companion(save, part)) as tmp:
                    getattr(prof, part).to_csv(tmp, index=False)
        # the engine's prefill and piecewise graphs, as profiled (older data: none)
        graphs = {}
        for key in ("prefill_graph_max_tokens", "piecewise_graph_max_tokens"):
            col = data.get(key, pd.Series(dtype=float)).dropna()
            graphs[key] = int(col.max()) if len(col) else 0
        base = dataclasses.replace(base, **graphs)
        hw, steps, elasticity = fit_gpu(data, spec, base, args.clock_elasticity)
        if args.data:  # the window timeline and clock samples saved beside the data, if any
            parts = [_companion(Path(args.data), part) for part in ("timeline", "clock")]
            timeline, clock = (pd.read_csv(f) if f.exists() else pd.DataFrame() for f in parts)
        else:
            timeline, clock = prof.timeline, prof.clock
        hw, clock_err = fit_clock(data, timeline, clock, spec, hw, elasticity)
        overhead, oerr = fit_overhead(data, args.overhead_name)
    except (ValueError, OSError, pd.errors.ParserError) as err:
        raise SystemExit(f"error: {err}") from None
    terms = term_errors(steps)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = "python -m experiments.calibrate " + " ".join(argv if argv is not None else
                                                            __import__("sys").argv[1:])
    err_lines = "\n".join(f"  {r.term}: median |err| {r.median_abs_rel_error:.1%}, max "
                          f"{r.max_abs_rel_error:.1%} over {r.points} steps"
                          for r in terms.itertuples())
    hw_d = {f: getattr(hw, f) for f in hw.__dataclass_fields__}
    hw_d["name"] = args.name
    for k, _, _ in FIT_KEYS:
        hw_d[k] = float(f"{hw_d[k]:.6g}")
    clock_line = ("Power-limited clock (fitted on the sampled SM clock): " + (
        f"clock slowdown 1 + {clock_err['clock power slowdown']:.3g} u + "
        f"{clock_err['clock heat slowdown']:.3g} heat (tau {hw.clock_tau_s:.3g} s), rms error "
        f"{clock_err['clock slowdown rms']:.3f} over {clock_err['samples']:.0f} samples;\n"
        f"  step times follow {clock_err['elasticity']:.0%} of it ("
        + ("fitted" if args.clock_elasticity is None
           else f"--clock-elasticity {args.clock_elasticity:g}")
        + "), so the profile's slowdowns are that share" if clock_err else "not sampled, off"))
    header = (f"Calibrated by `{command}` on {stamp}, model {spec.name}.\n"
              f"Datasheet numbers from {base_name}; the fitted keys: "
              + ", ".join(k for k, _, _ in FIT_KEYS) + ".\n"
              "Fit error of step time (microbenchmarks and served synthetic runs):\n"
              f"{err_lines}\n{clock_line}\n"
              f"Data: {save}")
    write_yaml(Path(args.conf_dir) / "hardware" / f"{args.name}.yaml", hw_d, header)
    served = int((data["kind"] == "served").sum())
    oheader = (f"Calibrated by `{command}` on {stamp}: schedlab's real backend's CPU costs.\n"
               + (f"schedule_*: the GPU's idle time between two served windows (schedule, input\n"
                  f"preparation, launch, drain, update; older data: the timed CPU parts), fitted\n"
                  f"on {served} windows of served synthetic runs;\n"
                  "output_*: pythonization per step (async: overlaps the next step).\n"
                  if served >= MIN_SERVED_WINDOWS else
                  "schedule_*: Scheduler.schedule()+update() plus the runner's input preparation,\n"
                  "per window; output_*: pythonization per step (async: overlaps the next step)\n"
                  "plus update()'s per-step share.\n")
               + "\n".join(f"  {k}: median |err| {v:.1%}" for k, v in oerr.items()))
    write_yaml(Path(args.conf_dir) / "overhead" / f"{args.overhead_name}.yaml", overhead, oheader)
    print(terms.to_string(index=False))
    print(clock_line)
    print("overhead fit: " + ", ".join(f"{k} {v:.1%}" for k, v in oerr.items()))
    print(f"wrote {Path(args.conf_dir) / 'hardware' / (args.name + '.yaml')} and "
          f"{Path(args.conf_dir) / 'overhead' / (args.overhead_name + '.yaml')}")
    return {"hardware": hw_d, "overhead": overhead, "terms": terms, "overhead_errors": oerr}


if __name__ == "__main__":
    main()
