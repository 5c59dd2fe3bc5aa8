"""The GPU's power-limited SM clock, as a slowdown of the compute-bound part of each step.

Under a power limit the SM clock falls while tensor-core-heavy work runs: at once, with the
power the running step draws, and further as the chip heats under sustained load (its
leakage grows with temperature). Memory-bound work barely slows. The model:

    slow = 1 + beta * u + alpha * H        compute-bound terms run ``slow`` times longer
    dH/dt = (u - H) / tau                  heat: the recent tensor-core share, u = 0 when idle

with u a step's tensor-core share at full clock (``cost_model.step_cost``), beta
``clock_power_slowdown``, alpha ``clock_heat_slowdown`` and tau ``clock_tau_s``. Both
slowdowns 0 (every datasheet profile) turn it off; ``experiments.calibrate`` fits them on the
GPU's sampled clock (slow = max clock / clock).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from common.model_spec import ModelSpec
from simulator.cost_model import StepShape, stage_time, step_cost, window_stage_times
from simulator.hardware import HardwareSpec


class PowerClock:
    """The heat state of one GPU (or pipeline stage) over a run; prices windows at its clock."""

    def __init__(self, model: ModelSpec, hw: HardwareSpec) -> None:
        self.model, self.hw = model, hw
        self.on = hw.clock_power_slowdown > 0 or hw.clock_heat_slowdown > 0
        self.heat = 0.0
        self.t = 0.0  # when the GPU last went idle

    def slowdown(self, u: float) -> float:
        return 1.0 + self.hw.clock_power_slowdown * u + self.hw.clock_heat_slowdown * self.heat

    def rest_until(self, t: float) -> None:
        """Idle from the last step's end until ``t``: the heat decays."""
        if t > self.t:
            self.heat *= math.exp(-(t - self.t) / self.hw.clock_tau_s)
            self.t = t

    def run(self, u: float, seconds: float) -> None:
        """``seconds`` of work with tensor-core share ``u``: the heat moves toward ``u``."""
        if seconds <= 0:
            return
        self.heat = u + (self.heat - u) * math.exp(-seconds / self.hw.clock_tau_s)
        self.t += seconds

    def window_times(self, shapes: Sequence[StepShape], start: float,
                     scale: float = 1.0) -> list[float]:
        """Per-stage seconds of a window's steps when its first step starts at ``start``, each
        times ``scale``; the heat follows the scaled steps."""
        model, hw = self.model, self.hw
        if not self.on:
            return window_stage_times(shapes, model, hw, scale)
        self.rest_until(start)
        times = []
        for s in shapes:
            t_full, busy = step_cost(s, model, hw)
            u = busy / t_full if t_full > 0 else 0.0
            slow = self.slowdown(u)
            t = stage_time(s, model, hw, slow) * scale
            self.run(u, t)
            times.append(t)
        return times
