"""When requests arrive: a gamma (Poisson) process, or a trace's times relative to its first."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# The settings of the arrival process (kinds sharegpt and synthetic; a trace brings its times).
ARRIVAL_KEYS = frozenset({"request_rate", "burstiness"})

# A trace time beyond this many seconds (~31,700 years) is no time at all: a parse gone wrong or
# a unit error (Unix-epoch seconds are ~1.7e9; epoch milliseconds, ~1.7e12, are refused here).
MAX_TRACE_TIME = 1e12
# A replay longer than this (~116 days) after the first arrival is taken for a unit error too.
MAX_TRACE_SPAN = 1e7


def arrival_times(num_prompts: int, request_rate: float, burstiness: float, seed: int
                  ) -> np.ndarray:
    """Send times: all 0 for an infinite rate, else gamma gaps (shape b, mean 1/rate).

    The first request goes at t=0 and each later one one gap after the previous, exactly like
    benchmark_serving's get_request. The gaps come from a legacy RandomState seeded with
    ``seed``, which is the stream np.random.seed(seed) gives benchmark_serving, so a ShareGPT
    run sees the same arrival times as the vLLM benchmark did (gamma with shape 1 draws the
    same numbers as the v0.5/v0.6 exponential).
    """
    if math.isinf(request_rate):
        return np.zeros(num_prompts)
    theta = 1.0 / (request_rate * burstiness)
    gaps = np.random.RandomState(seed).gamma(shape=burstiness, scale=theta,
                                            size=max(num_prompts - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])


@dataclass(frozen=True, slots=True)
class TimeUnit:
    """The unit a trace format stamps its times in."""

    symbol: str  # "s"
    name: str  # "seconds"
    per_second: int  # units in a second


SECONDS = TimeUnit("s", "seconds", 1)
MILLISECONDS = TimeUnit("ms", "milliseconds", 1000)


def trace_arrival_times(times: Sequence[float], lines: Sequence[int], path: str, *,
                        column: str = "arrival_time", unit: TimeUnit = SECONDS,
                        time_scale: float = 1.0) -> list[float]:
    """A trace's sorted arrival times (in ``unit``) as seconds after its first arrival, times
    ``time_scale``.

    A run measures its duration from t=0, so a trace stamped with Unix-epoch times would
    otherwise report a rate near zero; shifting makes absolute and relative stamps replay
    alike. ``time_scale`` stretches the gaps between arrivals: 2 replays the trace at half its
    rate (twice as far apart), 0.5 at twice its rate. ``lines`` gives each time's line in
    ``path`` and ``column`` the time's column, for the error messages.
    """
    max_time = MAX_TRACE_TIME * unit.per_second
    for t, line in zip(times, lines, strict=True):
        if not (math.isfinite(t) and abs(t) <= max_time):
            raise ValueError(f"{path}:{line}: {column} {t!r} is beyond {max_time:g} {unit.symbol} "
                             f"(times are {unit.name})")
    if not times:
        return []
    first = times[0]
    span = (times[-1] - first) / unit.per_second
    if span > MAX_TRACE_SPAN:
        raise ValueError(f"{path}:{lines[-1]}: {column} {times[-1]!r} is {span:.4g} s after "
                         f"the first arrival (line {lines[0]}); a trace may span at most "
                         f"{MAX_TRACE_SPAN:g} s (times are {unit.name})")
    if not (time_scale > 0 and math.isfinite(time_scale * span)):
        raise ValueError(f"workload.time_scale must be > 0 and keep the replay finite, "
                         f"got {time_scale!r}")
    # Divided, not multiplied by 1e-3: 3053 ms is 3.053 s, not 3.0530000000000004.
    return [(t - first) / unit.per_second * time_scale for t in times]
