"""Measured results from a directory of result.json files (ours or vLLM's): each file checked,
the repeats of one configuration averaged."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from experiments.aggregate import parse_rate, row_of
from policies.base import POLICIES

METRICS = ["request_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
           "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms",
           "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms"]


def measured_from_dir(root: Path | Sequence[Path], skip_unreadable: bool = False
                      ) -> dict[tuple, dict[str, Any]]:
    """Measured results keyed by (policy, k, rate) from our or vLLM's result.json files under
    ``root`` (a directory, or several read as one).

    A vLLM benchmark_serving file names its policy through --metadata (policy=..., num_steps=...)
    or, failing that, is read as multi_step with its num_scheduler_steps (single_step if absent).
    Several files of one configuration are repeats of one measurement (the same workload and
    seed): each metric is their mean, and ``repeats`` / ``spread`` (max - min over the mean, per
    metric) say how much the measurement itself moved. Their KV caches may differ by a few
    blocks (free memory varies between processes); ``cache_sizes`` lists them, and
    validate.predict accepts that only where the simulator predicts the same for each of them.

    A file that cannot be read (a repeat cut short) is an error naming every such file unless
    ``skip_unreadable``; then each is named on stderr, as is every JSON file that is not a
    benchmark result. A result whose settings or metrics are not numbers is an error naming it.
    """
    runs: dict[tuple, list[dict[str, Any]]] = {}
    unreadable = []
    roots = [root] if isinstance(root, Path) else list(root)
    # a directory named twice, or inside another named, is read once
    for p in sorted({q.resolve() for r in roots for q in r.rglob("*.json")}):
        if p.is_dir() or (p.name == "config.json" and (p.parent / "result.json").exists()):
            continue  # a run's own config, beside its result
        try:
            res = json.loads(p.read_text())
        except json.JSONDecodeError as err:
            unreadable.append(f"{p} (not valid JSON: {err.msg}, line {err.lineno})")
            continue
        except UnicodeDecodeError:
            unreadable.append(f"{p} (not UTF-8 text)")
            continue
        except OSError as err:
            unreadable.append(f"{p} ({err.strerror or err})")
            continue
        if not isinstance(res, dict) or "request_throughput" not in res:
            print(f"note: --measured-dir: skipped {p}: not a benchmark result "
                  "(no request_throughput)", file=sys.stderr)
            continue
        row = measured_row(res, p)
        runs.setdefault((row["policy"], row["k"], row["request_rate"]), []).append(row)
    if unreadable and not skip_unreadable:
        raise ValueError(f"{len(unreadable)} unreadable file(s): " + "; ".join(unreadable)
                         + " (a repeat cut short? remove them, or pass --skip-unreadable)")
    for name in unreadable:
        print(f"note: --measured-dir: skipped unreadable {name}", file=sys.stderr)
    return {key: average_repeats(rows) for key, rows in runs.items()}


def measured_row(res: dict[str, Any], path: Path) -> dict[str, Any]:
    """The table row of one measured result file, its settings and metrics checked."""
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
    row["request_rate"], row["file"] = rate, str(path)
    arrivals = (ext.get("workload") or {}).get("arrivals") if ext else None
    if arrivals is not None:  # the requests as a client sent them (experiments.loadgen)
        trace = path.parent / str(arrivals)
        if not trace.is_file():
            raise ValueError(f"{path}: schedlab.workload.arrivals names {trace}, which is "
                             "missing")
        row["arrivals"] = str(trace)
    if ext is None:
        steps = res.get("num_steps", res.get("num_scheduler_steps"))
        row["policy"] = res.get("policy") or ("multi_step" if steps else "single_step")
        row["k"] = steps
        row["num_prompts"] = res.get("num_prompts") or res.get("completed")
        row["seed"] = res.get("seed", 0)  # benchmark_serving's default
    if row["policy"] not in POLICIES:
        raise ValueError(f"{path}: policy {row['policy']!r} is not one of "
                         + ", ".join(sorted(POLICIES)))
    for field, minimum in (("k", 1), ("num_prompts", 1), ("seed", 0), ("num_blocks", 1)):
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
    if isinstance(n, bool) or not isinstance(n, int) or n < minimum:
        raise ValueError(f"{path}: {field} must be an integer >= {minimum}, got {value!r}")
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
        for field in ("num_prompts", "seed", "max_concurrency", "overlap",
                      "tensor_parallel_size"):
            a, b = known(first.get(field)), known(r.get(field))
            if a != b:
                raise ValueError(f"{r.get('file', r['run_dir'])} and "
                                 f"{first.get('file', first['run_dir'])} measure the same "
                                 f"configuration with different {field} ({b!r} and {a!r})")
    sizes = {known(r.get("num_blocks")) for r in rows}
    out = {**first, "repeats": len(rows), "spread": {},
           "cache_sizes": sorted(int(b) for b in sizes if b is not None),
           "files": [r["file"] for r in rows if r.get("file")],
           # a client's own send times replay only one run: repeats use the seed's arrivals
           "arrivals": first.get("arrivals") if len(rows) == 1 else None}
    if len(rows) > 1 and any(r.get("arrivals") for r in rows):
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
