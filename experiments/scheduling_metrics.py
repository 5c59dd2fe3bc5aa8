"""What a scheduling policy is judged by, beyond benchmark_serving's metrics: tails (p90, p99)
and goodput per SLO class, slowdown against each request's service time alone, Jain's fairness
over slowdowns, and the longest time a request waited in the queue (docs/policies.md)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from experiments.metrics import RequestTimes, request_times
from policies.request import Request

# GPU seconds of a request served alone on an idle engine: its prefill then its decode steps
ServiceTimeFn = Callable[[Request], float]


def _tails(values: Sequence[float], name: str) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values, dtype=float) * 1e3
    return {f"median_{name}_ms": float(np.median(a)), f"p90_{name}_ms": float(np.percentile(a, 90)),
            f"p99_{name}_ms": float(np.percentile(a, 99))}


def meets(req: Request, t: RequestTimes, ttft_ms: float | None, tpot_ms: float | None) -> bool:
    """Whether a completed request met its targets (a one-token request has TPOT 0, as
    benchmark_serving's goodput counts it)."""
    if ttft_ms is not None and t.ttft * 1e3 > ttft_ms:
        return False
    return tpot_ms is None or (t.tpot or 0.0) * 1e3 <= tpot_ms


def jain_index(values: Sequence[float]) -> float:
    """(sum x)^2 / (n sum x^2): 1 when all are equal, 1/n when one takes everything."""
    a = np.asarray(values, dtype=float)
    return float(a.sum() ** 2 / (len(a) * (a * a).sum())) if len(a) and (a * a).sum() > 0 else 1.0


def scheduling_metrics(requests: Sequence[Request], duration: float,
                       service_time: ServiceTimeFn | None = None) -> dict[str, Any]:
    """Flat metrics of the whole run (result.json's top level), and ``classes``: per SLO class,
    its requests, goodput against the class's own targets, attainment and latency tails."""
    per = [(r, request_times(r)) for r in requests]
    done = [(r, t) for r, t in per if t.completed]
    out: dict[str, Any] = {
        "max_queueing_delay_ms": max((r.max_wait for r in requests), default=0.0) * 1e3}
    for name, get in (("ttft", lambda t: t.ttft), ("e2el", lambda t: t.e2el)):
        out.update({k: v for k, v in _tails([get(t) for _, t in done], name).items()
                    if not k.startswith("median")})
    out.update({k: v for k, v in _tails([t.tpot for _, t in done if t.tpot is not None],
                                         "tpot").items() if not k.startswith("median")})
    if service_time is not None and done:
        slow = np.array([t.e2el / service_time(r) for r, t in done])
        out.update(mean_slowdown=float(slow.mean()), p99_slowdown=float(np.percentile(slow, 99)),
                   jain_fairness_slowdown=jain_index(slow))
    classes: dict[str, dict[str, Any]] = {}
    for name in sorted({r.slo_class for r in requests if r.slo_class is not None}):
        mine = [(r, t) for r, t in per if r.slo_class == name]
        ok = [(r, t) for r, t in mine if t.completed]
        good = sum(meets(r, t, r.ttft_slo_ms, r.tpot_slo_ms) for r, t in ok)
        row: dict[str, Any] = {
            "num_requests": len(mine), "completed": len(ok),
            "priority": mine[0][0].priority, "ttft_slo_ms": mine[0][0].ttft_slo_ms,
            "tpot_slo_ms": mine[0][0].tpot_slo_ms,
            "request_goodput": good / duration, "slo_attainment": good / len(mine)}
        row.update(_tails([t.ttft for _, t in ok], "ttft"))
        row.update(_tails([t.tpot for _, t in ok if t.tpot is not None], "tpot"))
        row.update(_tails([t.e2el for _, t in ok], "e2el"))
        classes[name] = row
    if classes:
        out["classes"] = classes
        # every request against its own class's targets: the goodput a policy sweep compares
        out["class_goodput"] = sum(c["request_goodput"] for c in classes.values())
    return out


def class_columns(classes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The per-class metrics as flat table columns: ``<class>.<metric>``."""
    return {f"{name}.{k}": v for name, row in classes.items() for k, v in row.items()
            if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))}
