"""The discrete-event simulator: processes on one SimPy environment (one replica or a cluster behind a router) over the policies/ scheduler and cost models."""

from __future__ import annotations

from simulator.cost_model import StepShape, stage_time, step_time, window_gpu_times, window_shapes
from simulator.engine import simulate
from simulator.hardware import HardwareSpec, check_parallelism
from simulator.memory import blocks_per_engine, num_gpu_blocks
from simulator.outcome import SimResult
from simulator.overhead import OverheadSpec, scale_overhead

__all__ = [
    "HardwareSpec", "OverheadSpec", "SimResult", "StepShape", "blocks_per_engine",
    "check_parallelism", "num_gpu_blocks", "scale_overhead", "simulate", "stage_time",
    "step_time", "window_gpu_times", "window_shapes",
]
