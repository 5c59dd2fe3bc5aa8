"""A background sampler of the GPU's SM clock, power draw and temperature (NVML).

``experiments.calibrate`` records these samples beside its microbenchmarks and fits the
simulator's power-limited clock term on them; ``benchmarks/h200_suite.py`` records them during
served runs. NVML comes from the ``nvidia-ml-py`` package; ``ClockSampler.for_device`` gives a
sampler of the GPU torch runs on, or None where none can be had (no package, driver or GPU).
"""

from __future__ import annotations

import os
import threading
import time

import pandas as pd


class ClockSampler(threading.Thread):
    """Samples one GPU every ``period`` seconds until ``stop()``; ``frame()`` holds the samples
    (``t`` in ``time.perf_counter()`` seconds, ``sm_mhz``, ``power_w``, ``temp_c``). A sample
    NVML cannot take (power or temperature unsupported, say) is skipped, not fatal."""

    def __init__(self, handle, period: float = 0.01) -> None:
        super().__init__(daemon=True)
        import pynvml

        self._nvml = pynvml
        self._handle = handle
        self.max_sm_mhz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)
        self.period = period
        self._rows: list[tuple[float, int, float, int]] = []
        self._halt = threading.Event()

    @classmethod
    def for_device(cls, index: int = 0, period: float = 0.01) -> ClockSampler | None:
        """A sampler of the GPU torch calls ``cuda:index`` (found by UUID, as NVML numbers
        GPUs without regard to CUDA_VISIBLE_DEVICES), or None where NVML cannot give one."""
        try:
            import pynvml
            import torch

            pynvml.nvmlInit()
            uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(
                    uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            except Exception:  # no UUID from torch: the index, if no device list renumbers GPUs
                if os.environ.get("CUDA_VISIBLE_DEVICES"):
                    return None
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            return cls(handle, period)
        except Exception:  # no package, driver or GPU: the clock is simply not recorded
            return None

    def run(self) -> None:
        n, h = self._nvml, self._handle
        while not self._halt.is_set():
            try:
                self._rows.append((time.perf_counter(),
                                   n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
                                   n.nvmlDeviceGetPowerUsage(h) / 1000.0,
                                   n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)))
            except n.NVMLError:
                pass
            time.sleep(self.period)

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(list(self._rows), columns=["t", "sm_mhz", "power_w", "temp_c"])
