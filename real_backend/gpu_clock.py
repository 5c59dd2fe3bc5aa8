"""A background sampler of the GPU's SM clock, power draw and temperature (NVML).

The simulator's power-limited clock term is fitted on these samples (``experiments.calibrate``)
and ``benchmarks/clock_probe.py`` records them beside bursts of steps. NVML comes from the
``nvidia-ml-py`` package; ``ClockSampler.available()`` says whether it can be used here.
"""

from __future__ import annotations

import threading
import time

import pandas as pd


class ClockSampler(threading.Thread):
    """Samples GPU ``index`` every ``period`` seconds until ``stop()``; ``frame()`` holds the
    samples (``t`` in ``time.perf_counter()`` seconds, ``sm_mhz``, ``power_w``, ``temp_c``)."""

    def __init__(self, index: int = 0, period: float = 0.01) -> None:
        super().__init__(daemon=True)
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.max_sm_mhz = pynvml.nvmlDeviceGetMaxClockInfo(self._handle, pynvml.NVML_CLOCK_SM)
        self.period = period
        self._rows: list[tuple[float, int, float, int]] = []
        self._halt = threading.Event()

    @staticmethod
    def available() -> bool:
        try:
            import pynvml

            pynvml.nvmlInit()
            return pynvml.nvmlDeviceGetCount() > 0
        except Exception:  # no package, no driver or no GPU: the clock is simply not recorded
            return False

    def run(self) -> None:
        n, h = self._nvml, self._handle
        while not self._halt.is_set():
            self._rows.append((time.perf_counter(), n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
                               n.nvmlDeviceGetPowerUsage(h) / 1000.0,
                               n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)))
            time.sleep(self.period)

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(list(self._rows), columns=["t", "sm_mhz", "power_w", "temp_c"])
