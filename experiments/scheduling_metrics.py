"""What a scheduling policy is judged by, beyond benchmark_serving's metrics: tails (p90, p99)
and goodput per SLO class, slowdown against each request's service time alone, Jain's fairness
over slowdowns, and the longest time a request waited in the queue (docs/policies.md)."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from experiments.request_times import TimesTable, times_for
from policies.request import Request

# GPU seconds of requests served alone on an idle engine (their prefill then their decode
# steps), from their prompt lengths and max tokens
ServiceTimeFn = Callable[[np.ndarray, np.ndarray], np.ndarray]


def _tails(values: Sequence[float] | np.ndarray, name: str, *,
           median: bool = True) -> dict[str, float]:
    """p90 and p99 of ``values`` (seconds) in ms, with the median unless ``median`` is false."""
    if not len(values):
        return {}
    a = np.asarray(values, dtype=float) * 1e3
    p90, p99 = np.percentile(a, [90, 99])  # (each as np.percentile(a, q) gives it)
    out = {f"median_{name}_ms": float(np.median(a))} if median else {}
    return {**out, f"p90_{name}_ms": float(p90), f"p99_{name}_ms": float(p99)}


def _meets(t: TimesTable, ttft_ms: np.ndarray, tpot_ms: np.ndarray) -> np.ndarray:
    """Which requests met their own targets (NaN: none; a one-token request has TPOT 0, as
    benchmark_serving's goodput counts it); only completed requests' answers mean anything."""
    ok = ~(t.ttft * 1e3 > ttft_ms)
    ok &= ~(np.nan_to_num(t.tpot, nan=0.0) * 1e3 > tpot_ms)
    return ok


def _targets(requests: Sequence[Request], name: str) -> np.ndarray:
    """Each request's ``name`` target in ms, NaN where it has none (always met)."""
    return np.array([np.nan if getattr(r, name) is None else getattr(r, name) for r in requests],
                    dtype=float)


def jain_index(values: Sequence[float]) -> float:
    """(sum x)^2 / (n sum x^2): 1 when all are equal, 1/n when one takes everything."""
    a = np.asarray(values, dtype=float)
    return float(a.sum() ** 2 / (len(a) * (a * a).sum())) if len(a) and (a * a).sum() > 0 else 1.0


def scheduling_metrics(requests: Sequence[Request], duration: float,
                       service_time: ServiceTimeFn | None = None,
                       times: TimesTable | None = None) -> dict[str, Any]:
    """Flat metrics of the whole run (result.json's top level), and ``classes``: per SLO class,
    its requests, goodput against the class's own targets, attainment and latency tails.
    ``times``: the requests' TimesTable, when the caller has it already."""
    t = times_for(requests, times)
    done = t.completed
    out: dict[str, Any] = {
        "max_queueing_delay_ms": max(map(operator.attrgetter("max_wait"), requests),
                                     default=0.0) * 1e3}
    for name, values in (("ttft", t.ttft[done]), ("e2el", t.e2el[done]),
                         ("tpot", t.tpots(done))):
        out.update(_tails(values, name, median=False))
    if service_time is not None and done.any():
        n = len(requests)
        alone = service_time(
            np.fromiter(map(operator.attrgetter("prompt_len"), requests), np.int64, n)[done],
            np.fromiter(map(operator.attrgetter("max_tokens"), requests), np.int64, n)[done])
        slow = t.e2el[done] / alone
        out.update(mean_slowdown=float(slow.mean()), p99_slowdown=float(np.percentile(slow, 99)),
                   jain_fairness_slowdown=jain_index(slow))
    classes: dict[str, dict[str, Any]] = {}
    names = sorted(set(map(operator.attrgetter("slo_class"), requests)) - {None})
    if names:
        labels = np.array([r.slo_class for r in requests], dtype=object)
        met = done & _meets(t, _targets(requests, "ttft_slo_ms"), _targets(requests, "tpot_slo_ms"))
    for name in names:
        mine = labels == name
        ok = mine & done
        first = requests[int(np.argmax(mine))]
        good = int((mine & met).sum())
        n_mine = int(mine.sum())
        row: dict[str, Any] = {
            "num_requests": n_mine, "completed": int(ok.sum()),
            "priority": first.priority, "ttft_slo_ms": first.ttft_slo_ms,
            "tpot_slo_ms": first.tpot_slo_ms,
            "request_goodput": good / duration, "slo_attainment": good / n_mine}
        row.update(_tails(t.ttft[ok], "ttft"))
        row.update(_tails(t.tpots(ok), "tpot"))
        row.update(_tails(t.e2el[ok], "e2el"))
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
