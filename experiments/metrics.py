"""Serving metrics (TTFT, TPOT, ITL, E2EL, goodput, vLLM's peaks) in vLLM benchmark_serving form,
from a run's TimesTable, and the run's printout (its files: experiments/result_files.py)."""

from __future__ import annotations

import dataclasses
import math
import operator
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import numpy as np

from experiments.request_times import TimesTable, chunk_bounds, times_for
from experiments.result_files import PerRequest
from policies.base import check_settings
from policies.request import Request

METRICS = (("ttft", "TTFT", "Time to First Token"),
           ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
           ("itl", "ITL", "Inter-token Latency"),
           ("e2el", "E2EL", "End-to-end Latency"))
UNFINISHED = "unfinished"
METRIC_KEYS = tuple(key for key, _, _ in METRICS)
# vllm bench serve's per-request lists (its --save-detailed ones: latencies are the E2ELs, kept
# as e2els too for older readers; start_times are when each request was sent, in seconds)
PER_REQUEST_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "e2els", "latencies",
                    "start_times", "generated_texts", "errors")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")  # benchmark_serving's --goodput names


@dataclasses.dataclass(frozen=True, slots=True)
class ResultSettings:
    """What a run's result.json and summary hold: the ``metrics`` and ``goodput`` sections.

    ``percentile_metrics`` and ``metric_percentiles`` are benchmark_serving's
    ``--percentile-metrics`` and ``--metric-percentiles``: the summary shows the chosen metrics
    with those percentiles, and result.json gets their ``p{N}_{metric}_ms``, besides the mean,
    median, std and p99 of every metric, which it always holds. ``goodput`` maps a metric to
    its SLO in ms (``--goodput``); empty: no goodput.
    """

    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl")
    metric_percentiles: tuple[float, ...] = (99.0,)
    save_per_request: bool = True
    goodput: Mapping[str, float] = dataclasses.field(default_factory=dict)

    @property
    def percentiles(self) -> dict[str, list[float]]:
        """The percentiles result.json holds for each metric: p99 (always) and the chosen."""
        return {m: sorted({99.0, *(self.metric_percentiles if m in self.percentile_metrics
                                   else ())}) for m in METRIC_KEYS}

    @property
    def shown(self) -> dict[str, tuple[float, ...]]:
        """The percentiles the summary shows for each metric it shows."""
        return {m: self.metric_percentiles for m in self.percentile_metrics}


def _words(setting: str, value: Any) -> list[Any]:
    # benchmark_serving's comma-separated form ("ttft,tpot"), or a list ([ttft, tpot])
    if isinstance(value, str):
        items: list[Any] = [w.strip() for w in value.split(",")]
    elif isinstance(value, Sequence) and not isinstance(value, bytes):
        items = list(value)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        items = [value]
    else:
        raise ValueError(f"{setting} must be a list or a comma-separated string, got {value!r}")
    if not items or any(w == "" for w in items):
        raise ValueError(f"{setting} must name at least one value, got {value!r}")
    return items


def result_settings(metrics: Mapping[str, Any] | None,
                    goodput: Mapping[str, Any] | None) -> ResultSettings:
    """The ``metrics`` and ``goodput`` config sections, checked: an unknown setting, metric or
    percentile, or an SLO that is not a number >= 0, is a one-line error naming it."""
    metrics = dict(metrics or {})
    goodput = dict(goodput or {})
    check_settings("metrics", metrics, ("percentile_metrics", "metric_percentiles",
                                        "save_per_request"))
    check_settings("goodput", goodput, [f"{m}_ms" for m in GOODPUT_METRICS])
    chosen = []
    for m in _words("metrics.percentile_metrics", metrics.get("percentile_metrics",
                                                                "ttft,tpot,itl")):
        if m not in METRIC_KEYS:
            raise ValueError(f"metrics.percentile_metrics: {m!r} is not one of "
                             + ", ".join(METRIC_KEYS))
        if m not in chosen:
            chosen.append(m)
    percentiles = []
    for p in _words("metrics.metric_percentiles", metrics.get("metric_percentiles", "99")):
        try:
            value = float(p) if not isinstance(p, bool) else math.nan
        except (TypeError, ValueError):
            value = math.nan
        if not 0 <= value <= 100:  # NaN fails too
            raise ValueError(f"metrics.metric_percentiles: {p!r} is not a number in [0, 100]")
        if value not in percentiles:
            percentiles.append(value)
    save = metrics.get("save_per_request", True)
    if not isinstance(save, bool):
        raise ValueError(f"metrics.save_per_request must be true or false, got {save!r}")
    slos = {}
    for m in GOODPUT_METRICS:
        v = goodput.get(f"{m}_ms")
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise ValueError(f"goodput.{m}_ms must be a number of milliseconds >= 0 (or null), "
                             f"got {v!r}")
        slos[m] = float(v)
    return ResultSettings(tuple(chosen), tuple(percentiles), save, slos)


def _stats_ms(values: Sequence[float] | np.ndarray,
              percentiles: Sequence[float]) -> dict[str, float]:
    # benchmark_serving computes np.mean(xs or 0): an empty list reports 0, not NaN.
    xs = np.asarray(values if len(values) else [0.0], dtype=float)
    # One scratch array (a 1M-request run has tens of millions of ITLs, and fresh memory is
    # slow to touch): np.std's deviations worked out in it, then the order statistics from a
    # copy in it, partitioned in place; the same values numpy finds with arrays of its own.
    scratch = np.empty_like(xs)
    mean = np.add.reduce(xs, keepdims=True) / len(xs)  # np.std's steps, in its order
    np.subtract(xs, mean, out=scratch)
    np.multiply(scratch, scratch, out=scratch)
    std = float(np.sqrt(np.add.reduce(scratch) / len(xs))) * 1000
    np.copyto(scratch, xs)
    out = {"mean": float(np.mean(xs)) * 1000,
           "median": float(np.median(scratch, overwrite_input=True)) * 1000, "std": std}
    for p in percentiles:
        out[f"p{_p_word(p)}"] = float(np.percentile(scratch, p, overwrite_input=True)) * 1000
    return out


def _p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def _per_request_lists(t: TimesTable, prompt_lens: np.ndarray, arrivals: np.ndarray,
                       generated_texts: Sequence[str] | None, streamed: bool
                       ) -> dict[str, Any]:
    """summarize's per-request lists, in benchmark_serving's order (``streamed``: the lists of
    numbers as PerRequest sequences, made a chunk at a time as result.json is written)."""
    def column(values: np.ndarray) -> Sequence[Any]:
        return PerRequest.of(values) if streamed else values.tolist()

    return {
        "input_lens": column(prompt_lens),
        "output_lens": column(t.output_len),
        "ttfts": column(t.ttft),
        "itls": PerRequest.itls(t) if streamed else t.itl_lists(),
        "e2els": column(t.e2el),
        "latencies": column(t.e2el),
        "start_times": column(arrivals),
        "generated_texts": list(generated_texts) if generated_texts is not None
        else [""] * len(t),
        "errors": ["" if ok else UNFINISHED for ok in t.completed.tolist()],
    }


def summarize(requests: Sequence[Request], duration: float, *,
              percentiles: Sequence[float] | Mapping[str, Sequence[float]] = (99.0,),
              goodput: Mapping[str, float] | None = None,
              generated_texts: Sequence[str] | None = None,
              per_request: bool = True,
              times: TimesTable | None = None, streamed: bool = False) -> dict[str, Any]:
    """The benchmark_serving ``--save-result`` fields of a finished run.

    ``duration`` is the benchmark's wall time, first send to last finish, in seconds. Per-request
    lists (input_lens, output_lens, ttfts, itls, e2els, generated_texts, errors; left out
    without ``per_request``) keep request order and include unfinished requests the way
    benchmark_serving keeps failed ones; the statistics use completed requests only. TPOT is
    per request (e2el - ttft) / (output_len - 1), over requests with more than one output
    token; ITLs are pooled over requests. ``percentiles``: for every metric, or per metric.
    ``generated_texts`` default to empty strings, as benchmark_serving's are without text.
    ``times``: the requests' TimesTable, when the caller has it already. ``streamed``: the
    per-request lists of numbers as PerRequest sequences, made a chunk at a time when
    result.json is written (a 1M-request run's lists never exist whole).

    ``goodput`` (SLOs in ms by metric: ttft, tpot, e2el) gives ``request_goodput``: completed
    requests that meet every SLO given, per second, with benchmark_serving's rule that a request
    with one output token has TPOT 0; null without an SLO, as vllm bench serve writes it.
    ``failed`` counts the unfinished requests (vLLM's failed ones); ``max_output_tokens_per_s``
    and ``max_concurrent_requests`` are vLLM's peaks (peak_output_and_concurrency).
    """
    if not (isinstance(duration, (int, float)) and duration > 0 and math.isfinite(duration)):
        raise ValueError(f"duration must be a finite number > 0, got {duration!r}")
    by_metric = ({m: list(percentiles.get(m, ())) for m in METRIC_KEYS}
                 if isinstance(percentiles, Mapping) else {m: list(percentiles) for m in METRIC_KEYS})
    for p in (p for ps in by_metric.values() for p in ps):
        if not 0 <= p <= 100:
            raise ValueError(f"percentiles must lie in [0, 100], got {p}")
    if generated_texts is not None and len(generated_texts) != len(requests):
        raise ValueError(f"{len(generated_texts)} generated texts for {len(requests)} requests")
    t = times_for(requests, times)
    done = t.completed
    num_done = int(done.sum())
    prompt_lens = np.fromiter(map(operator.attrgetter("prompt_len"), requests), np.int64,
                              len(requests))
    total_input = int(prompt_lens[done].sum())
    total_output = int(t.output_len[done].sum())
    pooled = {"ttft": t.ttft[done], "tpot": t.tpots(done), "itl": t.itls,
              "e2el": t.e2el[done]}
    summary: dict[str, Any] = {
        "duration": float(duration),
        "completed": num_done,
        "failed": len(t) - num_done,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": num_done / duration,
        "request_goodput": _num_good(t, goodput) / duration if goodput else None,
    }
    summary.update({
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    })
    arrivals = np.fromiter(map(operator.attrgetter("arrival_time"), requests), float,
                           len(requests))
    if per_request:
        summary.update(_per_request_lists(t, prompt_lens, arrivals, generated_texts, streamed))
    summary["max_output_tokens_per_s"], summary["max_concurrent_requests"] = \
        peak_output_and_concurrency(arrivals[done], t, done)
    for key in METRIC_KEYS:
        for stat, value in _stats_ms(pooled[key], by_metric[key]).items():
            summary[f"{stat}_{key}_ms"] = value
    return summary


def peak_output_and_concurrency(starts: Sequence[float] | np.ndarray, times: TimesTable,
                                done: np.ndarray | None = None) -> tuple[float, int]:
    """vllm bench serve's ``max_output_tokens_per_s`` and ``max_concurrent_requests``: the time
    from the first send in whole-second buckets; a request's tokens counted in the bucket each
    arrived in (vLLM's rule: one token at the first token, one at each ITL after it, i.e. one
    per streamed chunk), and a request counted in every bucket from its send to its end; the
    fullest bucket of tokens, and the fullest of requests. ``starts``: the send times of the
    requests ``done`` picks of ``times`` (default: all of them). The buckets take memory as
    the tokens do, not as the seconds the run spans (PerSecond)."""
    done = np.ones(len(times), bool) if done is None else done
    if not done.any():
        return 0.0, 0
    start = np.asarray(starts, dtype=float)
    t0 = float(start.min())
    first = start + times.ttft[done]
    end = start + times.e2el[done]
    buckets = int(np.ceil(float(end.max()) - t0)) + 1
    counts = np.diff(times.itl_start)[done]
    offset = np.cumsum(counts) - counts  # each request's first ITL in times.itls
    dense = buckets <= max(len(first) + int(counts.sum()), PerSecond.DENSE_SECONDS)
    tokens = PerSecond(buckets, dense)
    tokens.add((first - t0).astype(np.int64))
    # Each later chunk's time: its request's first token plus the ITLs up to it, from the
    # running sum of every ITL (the requests left out have none); a chunk of requests at a
    # time, the sum carried over as one np.cumsum would add it (a 1M-request run has tens of
    # millions of chunks)
    carry = 0.0  # the running sum before the chunk
    for a, b in chunk_bounds(len(counts)):
        lo, hi = int(offset[a]), int(offset[b - 1] + counts[b - 1])
        if hi == lo:
            continue
        run = np.cumsum(times.itls[lo:hi] if lo == 0 else
                        np.concatenate(([carry], times.itls[lo:hi])))
        if lo:
            before = run[offset[a:b] - lo]  # the running sum before each request's first ITL
            after = run[1:]
        else:
            before = np.concatenate(([0.0], run))[offset[a:b]]
            after = run
        before = np.where(offset[a:b] > 0, before, 0.0)
        carry = float(after[-1])
        after += np.repeat(first[a:b], counts[a:b])
        after -= np.repeat(before, counts[a:b])
        after -= t0
        tokens.add(after.astype(np.int64))
    running = PerSecond(buckets + 1, dense)  # a request joins in its send's second
    running.add((start - t0).astype(np.int64))
    running.add((end - t0).astype(np.int64) + 1, -1)  # and leaves after its end's
    return float(tokens.values().max()), int(np.cumsum(running.values()).max())


class PerSecond:
    """Counts of events in whole seconds 0..buckets-1 (an event outside them counts in none),
    in memory that follows the events rather than the seconds: ``dense``, one slot a second
    (the fastest, where the seconds are no more than the events); else only the seconds that
    hold an event (a run of a few requests spanning 1e8 s, a think time's). ``values()``: the
    counts second by second, every second or only those; their maximum and the maximum of
    their running sum are the same either way."""

    # a run spanning up to this many seconds (18 hours) is counted dense whatever its events
    DENSE_SECONDS = 1 << 16

    def __init__(self, buckets: int, dense: bool) -> None:
        self.buckets, self.dense = buckets, dense
        self._counts = np.zeros(buckets if dense else 0, np.int64)
        self._seconds: list[np.ndarray] = []
        self._weights: list[np.ndarray] = []

    def add(self, index: np.ndarray, weight: int = 1) -> None:
        """Count ``weight`` in the second of each of ``index``."""
        if len(index) and (index.min() < 0 or index.max() >= self.buckets):
            index = index[(index >= 0) & (index < self.buckets)]
        if self.dense:
            counts = np.bincount(index, minlength=self.buckets)
            self._counts += counts if weight == 1 else weight * counts
        else:
            seconds, counts = np.unique(index, return_counts=True)
            self._seconds.append(seconds)
            self._weights.append(weight * counts)

    def values(self) -> np.ndarray:
        if self.dense or not self._seconds:
            return self._counts
        seconds, slot = np.unique(np.concatenate(self._seconds), return_inverse=True)
        counts = np.zeros(len(seconds), np.int64)
        np.add.at(counts, slot, np.concatenate(self._weights))
        return counts


def _num_good(times: TimesTable, slos_ms: Mapping[str, float]) -> int:
    """Completed requests meeting every SLO given (benchmark_serving's calculate_metrics)."""
    unknown = set(slos_ms) - set(GOODPUT_METRICS)
    if unknown:
        raise ValueError(f"goodput has no metric {sorted(unknown)[0]!r}")
    good = times.completed.copy()
    value = {"ttft": times.ttft, "tpot": np.nan_to_num(times.tpot, nan=0.0), "e2el": times.e2el}
    for m, ms in slos_ms.items():
        good &= value[m] <= ms / 1000  # vLLM compares seconds to SLO/1000
    return int(good.sum())


def prefix_cache_hit_rate(requests: Sequence[Request]) -> float:
    """Prompt tokens found in the prefix cache at each request's first admission, over all
    prompt tokens (vLLM's prefix cache hit rate, by tokens)."""
    total = sum(map(operator.attrgetter("prompt_len"), requests))
    return (sum(map(operator.attrgetter("num_cached_prompt_tokens"), requests)) / total
            if total else 0.0)


def save_result_metadata(*, backend: str, model_id: str, tokenizer_id: str | None,
                         num_prompts: int, request_rate: float | None,
                         burstiness: float | None, max_concurrency: int | None,
                         date: datetime | None = None, label: str | None = None
                         ) -> dict[str, Any]:
    """vllm bench serve's ``--save-result`` header, in its order (request_rate inf is written
    "inf"; a trace's None: its times come from the file): ``endpoint_type`` repeats the backend,
    as vLLM's does, and ``label`` is its --label (null by default)."""
    return {"date": (date or datetime.now()).strftime("%Y%m%d-%H%M%S"),
            "endpoint_type": backend, "backend": backend, "label": label,
            "model_id": model_id, "tokenizer_id": tokenizer_id, "num_prompts": num_prompts,
            "request_rate": request_rate, "burstiness": burstiness,
            "max_concurrency": max_concurrency}


# ---------------------------------------------------------------------------------------------
# The printout
# ---------------------------------------------------------------------------------------------

def _fmt_value(v: Any, width: int = 80) -> str:
    # Nested settings go on one line ("kind=sharegpt request_rate=inf ..."), so the printout
    # stays one screen; result.json keeps everything in full.
    if isinstance(v, Mapping):
        s = " ".join(f"{k}={_fmt_value(x, width)}" for k, x in v.items())
    elif isinstance(v, float | np.floating):
        s = f"{v:.2f}" if math.isfinite(v) and v != int(v) else str(v)
    elif isinstance(v, list) and v and all(isinstance(x, float) for x in v):
        s = "[" + ", ".join(f"{x:.2f}" for x in v) + "]"  # (per-position acceptance rates)
    else:
        s = str(v)
    return s if len(s) <= width else s[:width - 3] + "..."


# Labels of schedlab fields whose names alone mislead.
_LABELS = {"num_wasted_steps": "num_wasted_steps (decode slots)"}
# What vLLM counts, said where its numbers look wrong: where tokens stream several to a chunk
# (a multi-step window's), the peak counts chunks and ITL spans a chunk's tokens.
PEAK_NOTE = ("(peak below the mean: vLLM counts one token per streamed chunk, which may carry "
             "several, in whole seconds from the first send)")
ITL_NOTE = ("(ITL far above TPOT: vLLM's ITL is the gap between streamed chunks, which may "
            "carry several tokens; TPOT is per token)")
ITL_OVER_TPOT = 2.0  # mean ITL this many times mean TPOT, or more, is "far above"


def traffic_lines(summary: Mapping[str, Any]) -> list[str]:
    """benchmark_serving's (v0.6) traffic lines, from the --save-result header's fields."""
    rate = summary.get("request_rate")
    if rate is None:  # a trace: no rate, its own times
        return ["Traffic request rate: trace (the file's arrival times)",
                f"Maximum request concurrency: {summary.get('max_concurrency')}"]
    burstiness = summary.get("burstiness", 1.0)
    distribution = "Poisson process" if burstiness == 1.0 else "Gamma distribution"
    return [f"Traffic request rate: {float(rate)}",
            f"Burstiness factor: {burstiness} ({distribution})",
            f"Maximum request concurrency: {summary.get('max_concurrency')}"]


def format_summary(summary: Mapping[str, Any], extra: Mapping[str, Any] | None = None, *,
                   shown: Mapping[str, Sequence[float]] | None = None) -> str:
    """The run on one screen, laid out like benchmark_serving's printout plus a schedlab part.

    ``shown`` picks the metrics and the percentiles printed (ResultSettings.shown); by default
    every metric with every percentile the summary holds. The traffic lines head it when the
    summary carries the --save-result header (save_result_metadata).
    """
    lines = traffic_lines(summary) if "max_concurrency" in summary else []
    lines.append("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append(f"{label:<40} {format(value, fmt)}")

    row("Successful requests:", summary["completed"])
    num_prompts = summary.get("num_prompts", len(summary.get("input_lens", [])))
    if num_prompts > summary["completed"]:
        row("Unfinished requests:", num_prompts - summary["completed"])
    row("Benchmark duration (s):", summary["duration"], ".2f")
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"], ".2f")
    if summary.get("request_goodput") is not None:
        row("Request goodput (req/s):", summary["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", summary["output_throughput"], ".2f")
    if summary.get("max_output_tokens_per_s") is not None:
        row("Peak output token throughput (tok/s):", summary["max_output_tokens_per_s"], ".2f")
        if summary["max_output_tokens_per_s"] < summary["output_throughput"]:
            lines.append(PEAK_NOTE)
        row("Peak concurrent requests:", summary["max_concurrent_requests"], ".2f")
    row("Total Token throughput (tok/s):", summary["total_token_throughput"], ".2f")
    for key, name, header in METRICS:
        if f"mean_{key}_ms" not in summary or (shown is not None and key not in shown):
            continue
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {name} (ms):", summary[f"mean_{key}_ms"], ".2f")
        row(f"Median {name} (ms):", summary[f"median_{key}_ms"], ".2f")
        if shown is None:
            pct = sorted((k[1:].split("_")[0] for k in summary
                          if re.fullmatch(rf"p[0-9.]+_{key}_ms", k)), key=float)
        else:  # in the order given, as benchmark_serving prints them
            pct = [_p_word(p) for p in shown[key]]
        for p in pct:
            row(f"P{p} {name} (ms):", summary[f"p{p}_{key}_ms"], ".2f")
        if key == "itl" and summary.get("mean_tpot_ms", 0) > 0 and \
                summary["mean_itl_ms"] >= ITL_OVER_TPOT * summary["mean_tpot_ms"]:
            lines.append(ITL_NOTE)
    if extra:
        lines.append("{s:{c}^{n}}".format(s=" schedlab ", n=50, c="-"))
        for k, v in extra.items():
            lines.append(f"{_LABELS.get(k, k) + ':':<40} {_fmt_value(v)}")
    lines.append("=" * 50)
    return "\n".join(lines)
