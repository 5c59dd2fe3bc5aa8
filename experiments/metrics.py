"""Serving metrics (TTFT, TPOT, ITL, E2EL) in vLLM benchmark_serving form, and the run's result files."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import enum
import io
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from experiments.files import write_text_atomic
from policies.request import Request

METRICS = (("ttft", "TTFT", "Time to First Token"),
           ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
           ("itl", "ITL", "Inter-token Latency"),
           ("e2el", "E2EL", "End-to-end Latency"))
REQUEST_CSV_COLUMNS = ("request_id", "arrival_time", "prompt_len", "output_len",
                       "first_scheduled_time", "ttft", "e2el", "tpot", "num_chunks",
                       "num_preemptions", "finish_time")
UNFINISHED = "unfinished"


@dataclasses.dataclass(slots=True)
class RequestTimes:
    """What a streaming client saw of one request (times in seconds)."""

    completed: bool
    output_len: int
    ttft: float = 0.0
    e2el: float = 0.0
    tpot: float | None = None  # None with fewer than two output tokens
    itls: list[float] = dataclasses.field(default_factory=list)
    num_chunks: int = 0


def request_times(req: Request) -> RequestTimes:
    """TTFT, ITLs, TPOT and E2EL of one request from its token delivery times.

    A chunk is the set of tokens delivered at one instant (equal token_times: a backend stamps
    a burst with one clock reading), so with multi-step a chunk may carry up to k tokens and
    the ITLs are the gaps between successive chunks, as benchmark_serving measures them.
    A request counts as completed once it has a finish_time; unfinished ones look like
    benchmark_serving's failed requests (output_len 0, no latencies).
    """
    if req.finish_time is None:
        return RequestTimes(completed=False, output_len=0)
    times = req.token_times
    if not times:
        raise ValueError(f"request {req.request_id} finished but has no token_times")
    if len(times) != req.num_output_tokens:
        raise ValueError(f"request {req.request_id} has {len(times)} token_times but "
                         f"num_output_tokens = {req.num_output_tokens}")
    if times[0] < req.arrival_time:
        raise ValueError(f"request {req.request_id}: first token at {times[0]} is before its "
                         f"arrival at {req.arrival_time}")
    chunks = [times[0]]
    for t in times[1:]:
        if t < chunks[-1]:
            raise ValueError(f"request {req.request_id}: token_times go backwards ({chunks[-1]} "
                             f"then {t})")
        if t != chunks[-1]:
            chunks.append(t)
    ttft = chunks[0] - req.arrival_time
    e2el = chunks[-1] - req.arrival_time
    n = len(times)
    return RequestTimes(completed=True, output_len=n, ttft=ttft, e2el=e2el,
                        tpot=(e2el - ttft) / (n - 1) if n > 1 else None,
                        itls=[b - a for a, b in zip(chunks[:-1], chunks[1:], strict=True)],
                        num_chunks=len(chunks))


def _stats_ms(values: list[float], percentiles: Sequence[float]) -> dict[str, float]:
    # benchmark_serving computes np.mean(xs or 0): an empty list reports 0, not NaN.
    xs = values or [0.0]
    out = {"mean": float(np.mean(xs)) * 1000, "median": float(np.median(xs)) * 1000,
           "std": float(np.std(xs)) * 1000}
    for p in percentiles:
        out[f"p{_p_word(p)}"] = float(np.percentile(xs, p)) * 1000
    return out


def _p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def summarize(requests: Sequence[Request], duration: float, *,
              percentiles: Sequence[float] = (99.0,)) -> dict[str, Any]:
    """The benchmark_serving ``--save-result`` fields of a finished run.

    ``duration`` is the benchmark's wall time, first send to last finish, in seconds. Per-request
    lists (input_lens, output_lens, ttfts, itls, e2els, errors) keep request order and include
    unfinished requests the way benchmark_serving keeps failed ones; the statistics use
    completed requests only. TPOT is per request (e2el - ttft) / (output_len - 1), over
    requests with more than one output token; ITLs are pooled over requests.
    """
    if not (isinstance(duration, (int, float)) and duration > 0 and math.isfinite(duration)):
        raise ValueError(f"duration must be a finite number > 0, got {duration!r}")
    for p in percentiles:
        if not 0 <= p <= 100:
            raise ValueError(f"percentiles must lie in [0, 100], got {p}")
    per = [request_times(r) for r in requests]
    done = [t for t in per if t.completed]
    total_input = sum(r.prompt_len for r, t in zip(requests, per, strict=True) if t.completed)
    total_output = sum(t.output_len for t in done)
    pooled = {"ttft": [t.ttft for t in done],
              "tpot": [t.tpot for t in done if t.tpot is not None],
              "itl": [x for t in done for x in t.itls],
              "e2el": [t.e2el for t in done]}
    summary: dict[str, Any] = {
        "duration": float(duration),
        "completed": len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "input_lens": [r.prompt_len for r in requests],
        "output_lens": [t.output_len for t in per],
        "ttfts": [t.ttft for t in per],
        "itls": [t.itls for t in per],
        "e2els": [t.e2el for t in per],
        "errors": ["" if t.completed else UNFINISHED for t in per],
    }
    for key, _, _ in METRICS:
        for stat, value in _stats_ms(pooled[key], percentiles).items():
            summary[f"{stat}_{key}_ms"] = value
    return summary


# ---------------------------------------------------------------------------------------------
# Result files
# ---------------------------------------------------------------------------------------------

def _jsonable(x: Any) -> Any:
    """A JSON-safe copy: numpy scalars to Python, paths to str, inf/nan to "inf"/"nan"
    (benchmark_serving writes request_rate inf as "inf"; bare Infinity is not JSON)."""
    if isinstance(x, float | np.floating):
        x = float(x)
        return x if math.isfinite(x) else ("nan" if math.isnan(x) else ("inf" if x > 0 else "-inf"))
    if isinstance(x, bool | np.bool_):
        return bool(x)
    if isinstance(x, int | np.integer):
        return int(x)
    if x is None or isinstance(x, str):
        return x
    if isinstance(x, enum.Enum):
        return _jsonable(x.value)
    if isinstance(x, os.PathLike):
        return os.fspath(x)
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _jsonable(dataclasses.asdict(x))
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, Sequence | set | frozenset):
        return [_jsonable(v) for v in x]
    raise ValueError(f"result value {x!r} of type {type(x).__name__} cannot be written as JSON")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not supported everywhere; the renames are already atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _csv_text(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(rows)
    return buf.getvalue()


def _cell(x: Any) -> Any:
    return "" if x is None else x


def requests_csv(requests: Sequence[Request]) -> str:
    """One row per request; empty cells where a value does not exist (unfinished, 1 token)."""
    rows = []
    for r in requests:
        t = request_times(r)
        rows.append([r.request_id, r.arrival_time, r.prompt_len, r.num_output_tokens,
                     _cell(r.first_scheduled_time), t.ttft if t.completed else "",
                     t.e2el if t.completed else "", _cell(t.tpot), t.num_chunks,
                     r.num_preemptions, _cell(r.finish_time)])
    return _csv_text(REQUEST_CSV_COLUMNS, rows)


def _steps_csv(steps: Any) -> str:
    """Per-step records (mappings, dataclasses or a DataFrame) as CSV."""
    if hasattr(steps, "to_csv"):
        return steps.to_csv(index=False, lineterminator="\n")
    rows = []
    for s in steps:
        if dataclasses.is_dataclass(s) and not isinstance(s, type):
            rows.append(dataclasses.asdict(s))
        elif isinstance(s, Mapping):
            rows.append(dict(s))
        else:
            raise ValueError(f"steps rows must be mappings or dataclasses, got {type(s).__name__}")
    header: list[str] = []
    for row in rows:  # union of keys, first-seen order
        header += [k for k in row if k not in header]
    return _csv_text(header, [[_cell(row.get(k)) for k in header] for row in rows])


# A run's result files, result.json first: it is removed first and written last, so its presence
# means every other file beside it comes from the same run (resumable sweeps skip on it).
RESULT_FILES = ("result.json", "requests.csv", "steps.csv")


def clear_results(run_dir: str | os.PathLike[str]) -> None:
    """Remove a previous run's result files from run_dir (result.json first)."""
    run_dir = Path(run_dir)
    for name in RESULT_FILES:
        (run_dir / name).unlink(missing_ok=True)
    _fsync_dir(run_dir)


def write_results(run_dir: str | os.PathLike[str], summary: Mapping[str, Any],
                  requests: Sequence[Request], extra: Mapping[str, Any], *,
                  steps: Any = None) -> Path:
    """Write run_dir/result.json (summary + {"schedlab": extra}), requests.csv and, given
    per-step records, steps.csv, as one unit: a previous run's files are removed first, each
    file is written atomically, result.json last, and if any write fails (or is interrupted)
    none of them is left. Returns result.json's path."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # Everything is rendered before anything is written: a bad value leaves no new file.
    result = json.dumps(_jsonable({**summary, "schedlab": dict(extra)}), allow_nan=False)
    texts = [("requests.csv", requests_csv(requests))]
    if steps is not None:
        texts.append(("steps.csv", _steps_csv(steps)))
    texts.append(("result.json", result))
    clear_results(run_dir)
    try:
        for name, text in texts:
            write_text_atomic(run_dir / name, text)
    except BaseException:
        with contextlib.suppress(OSError):  # the write's own error is the one to report
            clear_results(run_dir)
        raise
    _fsync_dir(run_dir)
    return run_dir / "result.json"


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
    else:
        s = str(v)
    return s if len(s) <= width else s[:width - 3] + "..."


def format_summary(summary: Mapping[str, Any], extra: Mapping[str, Any] | None = None) -> str:
    """The run on one screen, laid out like benchmark_serving's printout plus a schedlab part."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append(f"{label:<40} {format(value, fmt)}")

    row("Successful requests:", summary["completed"])
    unfinished = len(summary.get("input_lens", [])) - summary["completed"]
    if unfinished > 0:
        row("Unfinished requests:", unfinished)
    row("Benchmark duration (s):", summary["duration"], ".2f")
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"], ".2f")
    row("Output token throughput (tok/s):", summary["output_throughput"], ".2f")
    row("Total Token throughput (tok/s):", summary["total_token_throughput"], ".2f")
    for key, name, header in METRICS:
        if f"mean_{key}_ms" not in summary:
            continue
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {name} (ms):", summary[f"mean_{key}_ms"], ".2f")
        row(f"Median {name} (ms):", summary[f"median_{key}_ms"], ".2f")
        pct = [k for k in summary if re.fullmatch(rf"p[0-9.]+_{key}_ms", k)]
        for k in sorted(pct, key=lambda k: float(k[1:].split("_")[0])):
            row(f"P{k[1:].split('_')[0]} {name} (ms):", summary[k], ".2f")
    if extra:
        lines.append("{s:{c}^{n}}".format(s=" schedlab ", n=50, c="-"))
        for k, v in extra.items():
            lines.append(f"{k + ':':<40} {_fmt_value(v)}")
    lines.append("=" * 50)
    return "\n".join(lines)
