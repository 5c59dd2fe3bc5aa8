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
# No arrival, and no wait for one (a think time), reaches past this many seconds of a run
# (2^32 s, ~136 years): the clock is float64 seconds, which resolve a microsecond (the scale of
# the smallest costs the simulator prices) up to there and ever more coarsely beyond, and the
# peaks count the run's seconds as int64. A rate or think time that goes beyond is an error
# before the run, not a clock that rounds its costs away or overflows.
MAX_CLOCK = 2.0 ** 32
CLOCK_RULE = "a run's clock is kept below 2^32 s (~136 years), where float64 seconds still " \
    "resolve a microsecond"


def arrival_times(num_prompts: int, request_rate: float, burstiness: float, seed: int
                  ) -> np.ndarray:
    """Send times: all 0 for an infinite rate, else gamma gaps (shape b, mean 1/rate).

    The first request goes at t=0 and each later one one gap after the previous, exactly like
    benchmark_serving's get_request. The gaps come from a legacy RandomState seeded with
    ``seed``, which is the stream np.random.seed(seed) gives benchmark_serving, so a ShareGPT
    run sees the same arrival times as the vLLM benchmark did (gamma with shape 1 draws the
    same numbers as the v0.5/v0.6 exponential).

    A rate whose mean gap, or whose last send, is beyond MAX_CLOCK is refused (naming
    workload.request_rate).
    """
    if math.isinf(request_rate):
        return np.zeros(num_prompts)
    if not request_rate * MAX_CLOCK >= 1:
        raise ValueError(f"workload.request_rate must be >= {1 / MAX_CLOCK:.3g} requests/s (a "
                         f"mean gap of at most 2^32 s), got {request_rate!r}: {CLOCK_RULE}")
    product = request_rate * burstiness
    theta = 1.0 / product if product > 0 else math.inf  # a burstiness of 1e-320: refused below
    with np.errstate(over="ignore", invalid="ignore"):  # (inf or nan: refused below)
        gaps = np.random.RandomState(seed).gamma(shape=burstiness, scale=theta,
                                                size=max(num_prompts - 1, 0))
        times = np.concatenate([[0.0], np.cumsum(gaps)])
    if not times[-1] <= MAX_CLOCK:
        raise ValueError(f"workload.request_rate = {request_rate!r} (burstiness {burstiness!r}) "
                         f"sends the last of {num_prompts} requests at {times[-1]:.4g} s: "
                         f"{CLOCK_RULE}")
    return times


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
    if not (time_scale > 0 and time_scale * span <= MAX_CLOCK):
        raise ValueError(f"workload.time_scale must be > 0 and keep the replay's {span:.4g} s "
                         f"within 2^32 s, got {time_scale!r}: {CLOCK_RULE}")
    # Divided, not multiplied by 1e-3: 3053 ms is 3.053 s, not 3.0530000000000004.
    return [(t - first) / unit.per_second * time_scale for t in times]
