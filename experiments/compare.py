"""Runs side by side: their key metrics in one table, each run's change against the first,
printed and written as CSV and Markdown.

    python -m experiments.compare RUN_DIR RUN_DIR [RUN_DIR ...] [--out DIR]

A RUN_DIR is a run's directory (its result.json; a result file itself, ours or vllm bench
serve's, is taken too), read as experiments.aggregate reads it. Above the metrics, the table
names the settings the runs differ in. The files go to --out (default outputs/compare, beside
Hydra's run directories, never into one): compare.csv (unrounded numbers) and compare.md.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pandas as pd

from experiments.aggregate import read_row
from experiments.files import write_text_atomic
from experiments.labels import SLO_COLUMNS, goodput_targets

DEFAULT_OUT = Path("outputs") / "compare"
FILES = ("compare.csv", "compare.md")

# The settings a row of the table names where the runs differ in them.
SETTINGS = ("backend", "policy", "k", "overlap", "model", "hardware", "overhead",
            "tensor_parallel_size", "num_replicas", "router", "workload", "request_rate",
            "burstiness", "max_concurrency", "num_prompts", "seed", "time_scale",
            *SLO_COLUMNS.values())

# How a metric's change against the first run is given: relative, in percentage points (a
# fraction's), or as a difference (a count's, which may start from 0).
RELATIVE, POINTS, DIFFERENCE = "%", "points", "difference"


@dataclass(frozen=True)
class Metric:
    column: str  # the aggregate table's
    name: str
    unit: str
    change: str = RELATIVE


LATENCIES = [Metric(f"{stat}_{key}_ms", f"{stat} {name}", "ms")
             for key, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"),
                               ("e2el", "E2EL"))
             for stat in ("mean", "median", "p90", "p99")]
METRICS = [Metric("request_throughput", "request throughput", "req/s"),
           Metric("offered_rate", "offered rate", "req/s"),
           Metric("output_throughput", "output token throughput", "tok/s"),
           Metric("request_goodput", "goodput", "req/s"),
           Metric("class_goodput", "goodput (each class's targets)", "req/s"),
           *LATENCIES,
           Metric("prefix_cache_hit_rate", "prefix cache hit rate", "%", POINTS),
           Metric("num_preemptions", "preemptions", "", DIFFERENCE),
           Metric("completed", "completed requests", "", DIFFERENCE)]
CLASS_GOODPUT = ".request_goodput"  # experiments/scheduling_metrics.py's per-class column


def read_run(path: Path) -> dict[str, Any]:
    """The table row of the run at ``path`` (its directory, or its result file); a path that
    holds none is a ValueError in one line saying what it is instead."""
    if path.is_file():
        return read_row(path)
    if not path.is_dir():
        raise ValueError(f"{path}: no such run directory")
    result = path / "result.json"
    if not result.is_file():
        below = sum(1 for _ in path.glob("*/**/result.json"))
        hint = (f"; {below} runs below it: name them (e.g. {path}/*/), or aggregate them with "
                f"python -m experiments.aggregate {path}") if below else ""
        raise ValueError(f"{path} has no result.json: not a run directory{hint}")
    return read_row(result)


def labels_of(paths: Sequence[Path]) -> list[str]:
    """A column name per run: its directory's name (a result file's own name unless it is
    result.json), or the paths as given where those names repeat."""
    names = [p.name if p.suffix == ".json" and p.name != "result.json" else
             (p.parent.name if p.is_file() else p.name) or str(p) for p in paths]
    return names if len(set(names)) == len(names) else [str(p) for p in paths]


def metrics_of(rows: Sequence[dict[str, Any]]) -> list[Metric]:
    """The metrics some run has: the fixed ones, goodput named by its targets, and each SLO
    class's goodput."""
    classes = dict.fromkeys(k[:-len(CLASS_GOODPUT)] for row in rows for k in row
                            if k.endswith(CLASS_GOODPUT))
    targets = {goodput_targets(row) for row in rows if _number(row.get("request_goodput"))
               is not None}
    goodput = f"goodput, {targets.pop()}" if len(targets) == 1 and "" not in targets else \
        "goodput (each run's goodput.* targets)"
    shown = [replace(m, name=goodput) if m.column == "request_goodput" else m for m in METRICS
             if any(_number(row.get(m.column)) is not None for row in rows)]
    at = next((i for i, m in enumerate(shown) if m.column == "class_goodput"), 0) + 1
    per_class = [Metric(f"{c}{CLASS_GOODPUT}", f"goodput of class {c}", "req/s")
                 for c in classes]
    return shown[:at] + per_class + shown[at:] if classes else shown


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
        return None
    return float(v)


def change(metric: Metric, value: Any, base: Any) -> float | None:
    """``value``'s change against ``base``: relative (in %), in points, or the difference;
    None where either is missing, or relative to 0 or an infinite value."""
    v, b = _number(value), _number(base)
    if v is None or b is None or math.isinf(v) or math.isinf(b):
        return None
    if metric.change == POINTS:
        return (v - b) * 100
    if metric.change == DIFFERENCE:
        return v - b
    return (v - b) / b * 100 if b else None


def compare_table(rows: Sequence[dict[str, Any]], labels: Sequence[str]) -> pd.DataFrame:
    """The comparison, a row per setting the runs differ in and per metric some run has; a
    column per run and, after each run but the first, its change against the first."""
    first = labels[0]
    records = []
    for key in SETTINGS:
        values = [row.get(key) for row in rows]
        if len({_setting_text(v) for v in values}) > 1:
            records.append({"metric": key, "name": key, "unit": "", "change": "",
                            **{label: v for label, v in zip(labels, values, strict=True)}})
    for m in metrics_of(rows):
        rec: dict[str, Any] = {"metric": m.column, "name": m.name, "unit": m.unit,
                               "change": m.change}
        for i, (label, row) in enumerate(zip(labels, rows, strict=True)):
            rec[label] = _number(row.get(m.column))
            if i:
                rec[f"{label} vs {first}"] = change(m, row.get(m.column), rows[0].get(m.column))
        records.append(rec)
    columns = ["metric", "name", "unit", "change", first]
    for label in labels[1:]:
        columns += [label, f"{label} vs {first}"]
    return pd.DataFrame.from_records(records, columns=columns)


def _setting_text(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def _value_text(v: Any, unit: str) -> str:
    n = _number(v)
    if n is None:
        return _setting_text(v)
    if math.isinf(n):
        return "inf" if n > 0 else "-inf"
    if unit == "%":
        return f"{n * 100:.1f}%"
    if unit == "":
        return f"{n:.0f}" if n.is_integer() else f"{n:.2f}"
    return f"{n:.2f}"


def _change_text(v: Any, kind: str) -> str:
    n = _number(v)
    if n is None:
        return ""
    if kind == POINTS:
        return f"{n:+.1f} pp"
    if kind == DIFFERENCE:
        return f"{n:+.0f}" if n.is_integer() else f"{n:+.2f}"
    return f"{n:+.1f}%"


def markdown(table: pd.DataFrame, labels: Sequence[str], paths: Sequence[Path]) -> str:
    """The comparison as a Markdown table, headed by what each column is."""
    first = labels[0]
    header = [first] + [c for label in labels[1:] for c in (label, f"{label} vs {first}")]
    lines = ["# Runs compared", "",
             "Runs: " + "; ".join(f"{label} = {p}" for label, p in zip(labels, paths,
                                                                         strict=True)) + ".",
             f"Changes against the first run ({first}): relative, in percentage points (pp) "
             "for a rate in %, a difference for a count. Settings: those the runs differ in.",
             "", "| | " + " | ".join(header) + " |", "|---|" + "---:|" * len(header)]
    for rec in table.to_dict("records"):
        name, unit, kind = rec["name"], rec["unit"], rec["change"]
        cells = [f"{name} ({unit})" if unit else name]
        for i, label in enumerate(labels):
            cells.append(_value_text(rec[label], unit) if kind else _setting_text(rec[label]))
            if i:
                cells.append(_change_text(rec[f"{label} vs {first}"], kind) if kind else "")
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def compare(paths: Sequence[str | Path], out: str | Path = DEFAULT_OUT
            ) -> tuple[pd.DataFrame, str, list[Path]]:
    """Read each run, build the table, write OUT/compare.csv and OUT/compare.md; the table,
    its Markdown and the files written."""
    paths = [Path(p) for p in paths]
    if len(paths) < 2:
        raise ValueError("give two or more run directories to compare")
    rows = [read_run(p) for p in paths]
    labels = labels_of(paths)
    table = compare_table(rows, labels)
    text = markdown(table, labels, paths)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory")
    out.mkdir(parents=True, exist_ok=True)
    written = [out / name for name in FILES]
    write_text_atomic(written[0], table.to_csv(index=False))
    write_text_atomic(written[1], text)
    return table, text, written


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="docs/running.md, 'Comparing runs'")
    ap.add_argument("runs", nargs="+", metavar="RUN_DIR",
                    help="run directories (each with its result.json), the first the baseline")
    ap.add_argument("--out", default=str(DEFAULT_OUT),
                    help=f"directory for compare.csv and compare.md (default {DEFAULT_OUT})")
    args = ap.parse_args(argv)
    try:
        _, text, written = compare(args.runs, args.out)
    except ValueError as err:  # a path that holds no run, an unreadable result
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except OSError as err:  # --out not writable
        print(f"error: cannot write the comparison: {err}", file=sys.stderr)
        sys.exit(2)
    print(text, end="")
    print(f"written: {', '.join(map(str, written))}")


if __name__ == "__main__":
    main()
