"""Measured results from a directory of result.json files (ours or vLLM's): each file checked,
the repeats of one configuration averaged."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from experiments.aggregate import (
    MAX_INT,
    UnreadableFile,
    check_row,
    parse_rate,
    read_json,
    row_of,
    short_repr,
)
from policies.base import POLICIES

METRICS = ["request_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
           "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms",
           "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms"]


# The integer settings of a result and their least values.
_COUNTS = {"k": 1, "num_prompts": 1, "seed": 0, "num_blocks": 1}

# A client's requests as sent, as workload=trace replays them (conf/workload/trace.yaml, csv).
ARRIVALS_HEADER = "arrival_time,prompt_len,output_len\n"
# vLLM's benchmark client's per-request lists (vllm bench serve --save-detailed): each request's
# send time (time.perf_counter), prompt and output tokens (the server's usage counts)
_CLIENT_LISTS = ("start_times", "input_lens", "output_lens")


def measured_from_dir(root: Path | Sequence[Path], skip_unreadable: bool = False,
                      assume_policy: tuple[str, int | None] | None = None
                      ) -> dict[tuple, dict[str, Any]]:
    """Measured results keyed by (policy, k, rate) from our or vLLM's result.json files under
    ``root`` (a directory, or several read as one).

    A vLLM benchmark_serving file names its policy through --metadata (policy=..., num_steps=...)
    or, failing that, is read as multi_step with its num_scheduler_steps; a file with neither
    is refused unless ``assume_policy`` (validate's --assume-policy: the policy and k) says what
    it ran. A file of ``vllm bench serve --save-detailed`` keeps its requests as sent
    (``sent``: client_requests), which validate replays as loadgen's arrivals.csv.
    Several files of one configuration are repeats of one measurement (the same workload and
    seed): each metric is their mean, and ``repeats`` / ``spread`` (max - min over the mean, per
    metric) say how much the measurement itself moved. Their KV caches may differ by a few
    blocks (free memory varies between processes); ``cache_sizes`` lists them, and
    validate.predict accepts that only where the simulator predicts the same for each of them.

    A file that cannot be read (a repeat cut short) is an error naming every such file unless
    ``skip_unreadable``; then they are named on stderr, as are the JSON files that are not
    benchmark results (one line per kind of skipped file). A result whose settings or metrics
    are not numbers is an error naming it.
    """
    runs: dict[tuple, list[dict[str, Any]]] = {}
    unreadable, not_results, empty = [], [], []
    roots = [root] if isinstance(root, Path) else list(root)
    resolved = [r.resolve() for r in roots]
    # a directory named twice, or inside another named, is read once
    for p in sorted({q.resolve() for r in roots for q in r.rglob("*.json")}):
        if p.is_dir() or (p.name == "config.json" and (p.parent / "result.json").exists()):
            continue  # a run's own config, beside its result
        try:
            res = read_json(p)
        except UnreadableFile as err:
            unreadable.append(f"{p} ({err.reason})")
            continue
        if not isinstance(res, dict) or "request_throughput" not in res:
            not_results.append(str(p))
            continue
        row = measured_row(res, p, next((r for r in resolved if p.is_relative_to(r)), None),
                           assume_policy)
        if all(known(row.get(m)) is None for m in METRICS):
            # a run that completed nothing: averaged in, it would count as a repeat
            empty.append(str(p))
            continue
        runs.setdefault((row["policy"], row["k"], row["request_rate"]), []).append(row)
    if unreadable and not skip_unreadable:
        raise ValueError(f"{len(unreadable)} unreadable file(s): " + "; ".join(unreadable)
                         + " (a repeat cut short? remove them, or pass --skip-unreadable)")
    for names, what in ((unreadable, "unreadable"),
                        (not_results, "not a benchmark result (no request_throughput)"),
                        (empty, "no metric is a number (all null or NaN)")):
        if len(names) == 1:
            print(f"note: --measured-dir: skipped {names[0]}: {what}", file=sys.stderr)
        elif names:
            print(f"note: --measured-dir: skipped {len(names)} files, {what}: "
                  + short_list(names), file=sys.stderr)
    return {key: average_repeats(rows) for key, rows in runs.items()}


def short_list(items: Sequence[str], most: int = 5) -> str:
    """Items on one line: the first ``most`` of them and how many more."""
    shown = "; ".join(items[:most])
    return shown + (f"; and {len(items) - most} more" if len(items) > most else "")


def measured_row(res: dict[str, Any], path: Path, root: Path | None = None,
                 assume_policy: tuple[str, int | None] | None = None) -> dict[str, Any]:
    """The table row of one measured result file, its settings and metrics checked.

    A vLLM file records its policy only through --metadata (``policy``, ``num_steps`` or
    ``num_scheduler_steps``); without it, ``assume_policy`` (policy, k) stands in, else the
    file is refused: taken for single_step in silence, it would be compared with the wrong
    simulation.

    A client's send times (``schedlab.workload.arrivals``) are read only from inside ``root``
    (the measured directory, resolved; the file's own directory if None): a result names
    them, and a result copied from elsewhere must not make validate read any file it names.
    """
    ext = res.get("schedlab")
    if ext is not None and not (isinstance(ext, dict)
                                and isinstance(ext.get("workload") or {}, dict)):
        raise ValueError(f"{path}: 'schedlab' and its 'workload' must be mappings")
    # each setting under the name the file gives it, for the errors
    if ext:
        names = {"request_rate": "schedlab.workload.request_rate", "k": "schedlab.k",
                 "num_prompts": "schedlab.workload.num_prompts",
                 "seed": "schedlab.workload.seed", "num_blocks": "schedlab.num_blocks"}
    else:
        names = {"request_rate": "request_rate",
                 "k": "num_steps" if "num_steps" in res else "num_scheduler_steps",
                 "num_prompts": "num_prompts" if res.get("num_prompts") else "completed",
                 "seed": "seed", "num_blocks": "num_blocks"}
    raw_rate = (ext.get("workload") or {}).get("request_rate") if ext else res.get("request_rate")
    if raw_rate is None:
        raise ValueError(f"{path}: no request_rate; cannot match it to a configuration")
    try:
        rate = checked_rate(raw_rate)
    except ValueError as err:
        raise ValueError(f"{path}: {names['request_rate']} {err}") from None
    row = row_of(res, path)
    row["request_rate"] = rate
    try:  # the counts are checked below, where vLLM's text ("300") is taken too
        check_row({k: v for k, v in row.items() if k not in _COUNTS})
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    row["file"] = str(path)
    row["failed"] = res.get("failed", res.get("num_failed"))  # loadgen's name before vLLM's
    arrivals = (ext.get("workload") or {}).get("arrivals") if ext else None
    if arrivals is not None:  # the requests as a client sent them (experiments.loadgen)
        row["arrivals"] = str(_arrivals_file(path, arrivals, root or path.parent.resolve()))
    if ext is None:
        row["sent"] = client_requests(res, path)
        steps = res.get("num_steps", res.get("num_scheduler_steps"))
        if res.get("policy"):
            row["policy"] = res["policy"]
        elif steps is not None:
            row["policy"] = "multi_step"  # vLLM V0's --num-scheduler-steps
        elif assume_policy is not None:
            row["policy"], steps = assume_policy
        else:
            raise ValueError(f"{path}: no policy recorded (a vLLM result saved without "
                             "--metadata); record it when measuring (vllm bench serve ... "
                             "--metadata policy=multi_step num_scheduler_steps=8) or give it "
                             "here (--assume-policy single_step, or multi_step:8)")
        row["k"] = steps
        row["num_prompts"] = res.get("num_prompts") or res.get("completed")
        row["seed"] = res.get("seed", 0)  # benchmark_serving's default
        row["num_blocks"] = res.get("num_blocks")  # the server's KV cache, if --metadata says
    if not isinstance(row["policy"], str) or row["policy"] not in POLICIES:
        raise ValueError(f"{path}: policy {row['policy']!r} is not one of "
                         + ", ".join(sorted(POLICIES)))
    for field, minimum in _COUNTS.items():
        row[field] = _count(path, names[field], row.get(field), minimum)
    if "num_steps" not in {f.name for f in fields(POLICIES[row["policy"]])}:
        row["k"] = None  # recorded as 1 by a policy without a step count
    elif row["k"] is None:
        raise ValueError(f"{path}: policy {row['policy']} without a step count "
                         "(num_steps or num_scheduler_steps)")
    for m in METRICS:
        v = row.get(m)
        if v is not None and v == v and (isinstance(v, bool) or not isinstance(v, (int, float))
                                         or not 0 <= v < math.inf):
            raise ValueError(f"{path}: {m} must be a finite number >= 0, got {v!r}")
    return row


def client_requests(res: dict[str, Any], path: Path) -> list[tuple[float, int, int]] | None:
    """The requests as vLLM's benchmark client sent them, from its --save-detailed lists: each
    one's send time (seconds after the first) and its prompt and output tokens as the server
    counted them, in send order. Under --max-concurrency a request's time is when it was due
    (its send less its queue_times entry): the simulator holds it back itself.

    None where the file has no such lists (saved without --save-detailed) or a request failed:
    a replay of the completed ones alone would be too light, as for experiments.loadgen. Lists
    that are not one number per request are an error naming the file and the list.
    """
    lists = {k: res.get(k) for k in _CLIENT_LISTS}
    if (not all(isinstance(v, list) for v in lists.values()) or res.get("failed")
            or not lists["start_times"]):
        return None
    n = len(lists["start_times"])
    held = res.get("max_concurrency") is not None
    lists["queue_times"] = res.get("queue_times") if held else [0.0] * n
    for name, values in lists.items():
        if not isinstance(values, list) or len(values) != n:
            raise ValueError(f"{path}: {name} must be a list of one entry per request (as "
                             f"start_times, {n}), got {short_repr(values)}")
        whole = name.endswith("_lens")
        for i, v in enumerate(values):
            if (isinstance(v, bool) or not isinstance(v, int if whole else (int, float))
                    or not (1 <= v <= MAX_INT if whole else 0 <= v < math.inf)):
                raise ValueError(f"{path}: {name}[{i}] must be "
                                 + ("an integer >= 1" if whole else "a finite number >= 0")
                                 + f", got {short_repr(v)}")
    due = [s - q for s, q in zip(lists["start_times"], lists["queue_times"], strict=True)]
    first = min(due)
    return sorted(zip([t - first for t in due], lists["input_lens"], lists["output_lens"],
                      strict=True))


def arrivals_csv(requests: Iterable[tuple[float, int, int]]) -> str:
    """A client's requests (send time, prompt and output tokens) as the csv trace that
    workload=trace replays, in send order."""
    return ARRIVALS_HEADER + "".join(f"{t:.6f},{p},{o}\n" for t, p, o in sorted(requests))


def _arrivals_file(path: Path, arrivals: Any, root: Path) -> Path:
    """The send-times file a result names, refused unless it lies inside ``root`` once resolved
    (symbolic links followed); its content is never quoted."""
    if not isinstance(arrivals, str) or not arrivals.strip() or "\x00" in arrivals:
        raise ValueError(f"{path}: schedlab.workload.arrivals must be a file name, got "
                         f"{short_repr(arrivals)}")
    try:
        trace = (path.parent / arrivals).resolve()
    except (OSError, RuntimeError):  # a loop of symbolic links
        raise ValueError(f"{path}: schedlab.workload.arrivals names a path that cannot be "
                         "resolved") from None
    if not trace.is_relative_to(root):
        raise ValueError(f"{path}: schedlab.workload.arrivals names a file outside the measured "
                         f"directory {root}; refused (copy the send times beside the result)")
    if not trace.is_file():
        raise ValueError(f"{path}: schedlab.workload.arrivals names {trace}, which is "
                         "missing")
    return trace


def _count(path: Path, field: str, value: Any, minimum: int) -> int | None:
    """An integer setting of a result file (vLLM's --metadata records "300" as text); None
    where not recorded."""
    if value is None or value != value:
        return None
    n = value
    if isinstance(n, str) and n.strip().lstrip("-").isdigit():
        n = int(n)
    elif isinstance(n, float) and n.is_integer():
        n = int(n)
    if isinstance(n, bool) or not isinstance(n, int) or not minimum <= n <= MAX_INT:
        raise ValueError(f"{path}: {field} must be an integer from {minimum} to 2**63 - 1, "
                         f"got {short_repr(value)}")
    return n


def checked_rate(value: Any) -> float:
    """A request rate (a number > 0, or inf) from a file or the command line."""
    try:
        if isinstance(value, bool):
            raise TypeError
        rate = parse_rate(value)
    except (TypeError, ValueError):
        rate = math.nan
    if not rate > 0:
        raise ValueError(f"must be a number > 0 or inf, got {value!r}")
    return rate


def average_repeats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's measurement from its repeats: the metrics' means, and their spread
    (NaN where fewer than two repeats have the metric)."""
    first = rows[0]
    for r in rows[1:]:
        for field in ("num_prompts", "seed", "max_concurrency", "overlap", "enable_prefix_caching",
                      "tensor_parallel_size"):
            a, b = known(first.get(field)), known(r.get(field))
            if a != b:
                raise ValueError(f"{r.get('file', r['run_dir'])} and "
                                 f"{first.get('file', first['run_dir'])} measure the same "
                                 f"configuration with different {field} ({b!r} and {a!r})")
    sizes = {known(r.get("num_blocks")) for r in rows}
    out = {**first, "repeats": len(rows), "spread": {},
           # each repeat's workload as measured (validate compares it with the simulated one)
           "workloads": [{k: r.get(k) for k in ("file", "completed", "total_input_tokens",
                                                "total_output_tokens", "failed")}
                         for r in rows],
           "cache_sizes": sorted(int(b) for b in sizes if b is not None),
           "files": [r["file"] for r in rows if r.get("file")],
           # a client's own send times replay only one run: repeats use the seed's arrivals
           "arrivals": first.get("arrivals") if len(rows) == 1 else None,
           "sent": first.get("sent") if len(rows) == 1 else None}
    if len(rows) > 1 and any(r.get("arrivals") or r.get("sent") for r in rows):
        print(f"note: {', '.join(out['files'])}: repeats of one configuration, each with the "
              "send times its client recorded; the simulator replays the seed's arrivals "
              "instead", file=sys.stderr)
    for m in METRICS:
        vals = [r[m] for r in rows if known(r.get(m)) is not None]
        if vals:
            mean = sum(vals) / len(vals)
            out[m] = mean
            out["spread"][m] = ((max(vals) - min(vals)) / mean if mean else 0.0) \
                if len(vals) > 1 else math.nan
    return out


def known(value: Any) -> Any:
    """A recorded value as a comparable one: None where not recorded (None or NaN), numbers
    (a vLLM file's metadata may hold "1") as floats."""
    if value is None or value != value:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return value
