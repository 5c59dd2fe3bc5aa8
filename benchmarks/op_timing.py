"""How benchmarks/operators.py times one operator: CUDA-graph replays of back-to-back calls timed
with CUDA events (the wall clock on the CPU), the host's launch time, and the SM clock per point.

A call's device time is the median over ``reps`` replays of one graph holding ``calls`` calls,
divided by ``calls``: inside a graph no launch gap separates the kernels, so the time is the
kernels' own, as in the engine's decode and piecewise graphs (launch and replay overheads have a
table of their own). Callers rotate over copies of what a call reads (weights, KV blocks) so
that repeated calls do not find it in L2, as each layer of a real forward reads its own.
"""

from __future__ import annotations

import datetime as dt
import math
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

L2_FALLBACK_BYTES = 50 * 2**20  # the H200's L2, where torch does not report the device's
# replay at least this long, so the events' few microseconds of resolution do not matter
TARGET_REPLAY_US = 200.0
MAX_CALLS = 256


@dataclass(slots=True)
class Timing:
    time_us: float  # device time of one call (median over replays); wall time on the CPU
    launch_us: float  # host time to issue one call eagerly (the CPU cost of an eager launch)
    calls: int  # calls per replay
    span: tuple[float, float]  # perf_counter seconds around the timed replays (clock lookup)


@dataclass(slots=True)
class Bench:
    """The device, the repetitions, and the SM-clock sampler (None without NVML or on CPU)."""

    device: torch.device
    reps: int
    sampler: Any = None
    stream: Any = None  # the side stream graphs are captured on (cuda)
    max_sm_mhz: float = math.nan  # NVML's maximum SM clock, once the sampler has started

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.cuda else torch.float32

    def l2_bytes(self) -> int:
        if not self.cuda:
            return 2**20
        props = torch.cuda.get_device_properties(self.device)
        return int(getattr(props, "L2_cache_size", 0) or L2_FALLBACK_BYTES)

    def copies(self, bytes_per_call: float, cap: int = 64) -> int:
        """Copies of a call's inputs to rotate over: together at least four times the L2."""
        return max(1, min(cap, math.ceil(4 * self.l2_bytes() / max(bytes_per_call, 1.0))))

    def calls(self, est_us: float, copies: int) -> int:
        """Calls per replay: at least one round of the copies, at least TARGET_REPLAY_US."""
        if not self.cuda:
            return max(1, min(copies, 2))
        return int(min(MAX_CALLS, max(copies, math.ceil(TARGET_REPLAY_US / max(est_us, 0.5)))))

    def time(self, fn: Callable[[], object], calls: int) -> Timing:
        """Time ``fn`` (which rotates over its copies itself) as the module docstring says."""
        if not self.cuda:
            return self._time_cpu(fn, calls)
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        torch.cuda.synchronize(self.device)
        with torch.cuda.stream(self.stream):
            fn()  # Triton compiles, cuBLAS picks its kernel and workspace on this stream
            fn()
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.stream):
            graph.capture_begin()
            try:
                for _ in range(calls):
                    fn()
            finally:
                graph.capture_end()
        torch.cuda.synchronize(self.device)
        graph.replay()  # the first replay uploads the graph
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.reps)]
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        for a, b in events:
            a.record()
            graph.replay()
            b.record()
        torch.cuda.synchronize(self.device)
        t1 = time.perf_counter()
        per_call = [a.elapsed_time(b) * 1e3 / calls for a, b in events]
        n_host = max(1, min(calls, 10))
        h0 = time.perf_counter()
        for _ in range(n_host):
            fn()
        launch = (time.perf_counter() - h0) * 1e6 / n_host
        torch.cuda.synchronize(self.device)
        del graph
        return Timing(statistics.median(per_call), launch, calls, (t0, t1))

    def _time_cpu(self, fn: Callable[[], object], calls: int) -> Timing:
        fn()
        per_call = []
        t0 = time.perf_counter()
        for _ in range(self.reps):
            a = time.perf_counter()
            for _ in range(calls):
                fn()
            per_call.append((time.perf_counter() - a) * 1e6 / calls)
        t1 = time.perf_counter()
        med = statistics.median(per_call)
        return Timing(med, med, calls, (t0, t1))

    def span_time(self, fn: Callable[[], object]) -> tuple[float, float, tuple[float, float]]:
        """One whole step as the engine issues it (a graph replay, or eager launches) from an
        idle GPU: (device us from before its launch to its end, host us to issue it, span);
        medians over ``reps``. On the CPU both are the wall time."""
        fn()
        fn()
        dev, host = [], []
        t0 = time.perf_counter()
        for _ in range(self.reps):
            if self.cuda:
                torch.cuda.synchronize(self.device)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                h0 = time.perf_counter()
                fn()
                host.append((time.perf_counter() - h0) * 1e6)
                b.record()
                torch.cuda.synchronize(self.device)
                dev.append(a.elapsed_time(b) * 1e3)
            else:
                h0 = time.perf_counter()
                fn()
                host.append((time.perf_counter() - h0) * 1e6)
                dev.append(host[-1])
        return statistics.median(dev), statistics.median(host), (t0, time.perf_counter())

    def queued_time(self, fn: Callable[[], object], queue: int = 8
                    ) -> tuple[float, tuple[float, float]]:
        """Device us of one whole step issued while the step before it still runs (steps 2..k
        of a window, whose launches wait in the stream): a step from an idle GPU, then
        ``queue`` more issued behind it, timed from the first one's end; median over ``reps``,
        and the span it ran in. On the CPU: the wall time of one call."""
        fn()
        fn()
        dev = []
        t0 = time.perf_counter()
        for _ in range(self.reps):
            if not self.cuda:
                h0 = time.perf_counter()
                fn()
                dev.append((time.perf_counter() - h0) * 1e6)
                continue
            torch.cuda.synchronize(self.device)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            fn()
            a.record()
            for _ in range(queue):
                fn()
            b.record()
            torch.cuda.synchronize(self.device)
            dev.append(a.elapsed_time(b) * 1e3 / queue)
        return statistics.median(dev), (t0, time.perf_counter())

    def start_clock(self) -> None:
        """Start sampling the SM clock (NVML); nothing where it cannot be had."""
        if self.cuda and self.sampler is None:
            from real_backend.gpu_clock import ClockSampler

            self.sampler = ClockSampler.for_device(self.device.index or 0, period=0.01)
            if self.sampler is not None:
                self.max_sm_mhz = float(self.sampler.max_sm_mhz)
                self.sampler.start()

    def stop_clock(self) -> Any:
        """The samples taken since start_clock (a DataFrame), or None."""
        if self.sampler is None:
            return None
        self.sampler.stop()
        frame = self.sampler.frame()
        self.sampler = None
        return frame


def clock_of_spans(frame: Any, spans: list[tuple[float, float]]) -> list[float]:
    """Each span's SM clock (MHz): the mean of the samples inside it, else the nearest sample's
    (a short point may fall between two samples); NaN without samples."""
    if frame is None or not len(frame):
        return [math.nan] * len(spans)
    t = frame["t"].to_numpy()
    mhz = frame["sm_mhz"].to_numpy(dtype=float)
    out = []
    for a, b in spans:
        inside = (t >= a) & (t <= b)
        out.append(float(mhz[inside].mean()) if inside.any()
                   else float(mhz[np.argmin(np.abs(t - (a + b) / 2))]))
    return out


def environment(bench: Bench) -> dict[str, Any]:
    """What a table was measured on: device, library versions, date."""
    import triton

    env: dict[str, Any] = {
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "device": str(bench.device), "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "dtype": str(bench.dtype).removeprefix("torch."),
        "reps": bench.reps, "host": platform.node(),
    }
    if bench.cuda:
        props = torch.cuda.get_device_properties(bench.device)
        env.update(gpu_name=props.name, num_sms=props.multi_processor_count,
                   l2_bytes=bench.l2_bytes(), cuda=torch.version.cuda,
                   total_memory_bytes=props.total_memory, max_sm_mhz=bench.max_sm_mhz)
    else:
        env["gpu_name"] = "cpu"
    return env
