"""Calibration measurements on the real backend: the profiling grid, the Profiler, its rows.

The profiling grid is made of hand-built windows (prefill chunks of many sizes, with and
without a cached prefix; decode windows of k steps over batch sizes x context lengths; mixed
batches) run through the real backend's ModelRunner, plus the CPU cost of the real Scheduler's
schedule() + update() against batch size. Windows with a prefill draw a new shape around their
nominal one for every timed repetition, as served windows never repeat one; the collector is
frozen while profiling, as it is while serving. Served runs of a synthetic workload on the same
runner add each window's CPU gap and each step's shape and time (never the validation's
ShareGPT runs). On a GPU with NVML the SM clock is sampled throughout (after two clock bursts)
and each window gets the clock it ran at. ``experiments.fit`` turns these rows into profiles.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

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
from simulator.cost_model import window_shapes

# the step-shape columns of every row (``simulator.cost_model.StepShape``'s fields)
SHAPE_COLS = ["num_tokens", "num_seqs", "num_prefill_tokens", "num_sampled", "attn_pairs",
              "kv_tokens", "is_first", "max_kv_tokens"]
OPTIONAL_COLS = {"max_kv_tokens"}  # absent from older data: read as 0 (term off)


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
        windows measure preparation dearer than served ones at small batches.
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
        self.rows.append({"kind": "scheduler", "k": k, "step": 0, "num_seqs": num_seqs,
                          "num_tokens": num_seqs,
                          "sched_s": scheduler_window_s(num_seqs, k, windows)})


def scheduler_window_s(num_seqs: int, k: int, windows: int) -> float:
    """Median seconds of schedule() + update() of a multi_step k Scheduler with ``num_seqs``
    decoding requests, over ``windows`` windows (the calibration's and a host profile's probe)."""
    s = decoding_scheduler(num_seqs, k)
    costs = []
    now = 0.0
    for _ in range(windows):
        t0 = time.perf_counter()
        b = s.schedule(now)
        s.update(b, [now + j for j in range(b.num_steps)])
        costs.append(time.perf_counter() - t0)
        now += k
    return statistics.median(costs)


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
