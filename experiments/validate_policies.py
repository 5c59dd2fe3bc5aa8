"""The simulator against an engine on the policies of the literature and on prefix caching:
each measured run (benchmarks/policy_suite.py, benchmarks/prefix_suite.py on the real engine,
benchmarks/vllm_suite.py on vLLM's) predicted from its own configuration and profiles taken
before it, never from the run itself, and scored against targets (docs/validation/policies.md,
docs/validation/prefix_cache.md, docs/validation/vllm.md).

    python -m experiments.validate_policies MEASURED_DIR [--out DIR] [--table policies]
                    [--hardware h200_calibrated] [--overhead schedlab_h200] [--sim-repeats 9]

Runs named ``NAME_r1``, ``NAME_r2``, ... are repeats of one configuration: the measured side is
their mean, and each error is shown beside the repeats' spread (max - min over the mean).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd

from experiments.files import write_table_markdown, write_text_atomic
from experiments.profiles import InputError, load_conf, one_line
from experiments.run import run
from experiments.validate import time_scales

# metric -> (how the error is counted, target): relative errors in %, goodput in points of
# SLO attainment (the share of requests meeting their class's targets)
TARGETS = {"request_throughput": ("rel", 3.0), "median_ttft_ms": ("rel", 10.0),
           "median_tpot_ms": ("rel", 10.0), "p90_ttft_ms": ("rel", 15.0),
           "p90_tpot_ms": ("rel", 15.0), "slo_attainment": ("points", 5.0),
           "prefix_cache_hit_rate": ("points", 1.0)}
TITLES = {"policies": "Policies: the simulator against the real engine",
          "prefix_cache": "Prefix caching: the simulator against the real engine",
          "vllm": "vLLM on the CPU: the simulator against vLLM's engine"}
ENGINES = ("real", "vllm")  # the backends whose runs are measurements
REPEAT = re.compile(r"_r\d+$")  # a repeat's suffix: NAME_r2 is the second repeat of NAME


def hit_rate(result: dict[str, Any]) -> float | None:
    """The prefix cache hit rate in %, where the run cached prefixes."""
    s = result.get("schedlab") or {}
    if not s.get("enable_prefix_caching") or s.get("prefix_cache_hit_rate") is None:
        return None
    return 100.0 * s["prefix_cache_hit_rate"]


def _metric(result: dict[str, Any], metric: str) -> float | None:
    if metric == "slo_attainment":
        return attainment(result)
    if metric == "prefix_cache_hit_rate":
        return hit_rate(result)
    return result.get(metric)


def attainment(result: dict[str, Any]) -> float | None:
    """The share of requests that met their own class's targets, in %."""
    classes = (result.get("schedlab") or {}).get("classes")
    if not classes:
        return None
    n = sum(c["num_requests"] for c in classes.values())
    return 100.0 * sum(c["slo_attainment"] * c["num_requests"] for c in classes.values()) / n


def measured_runs(root: Path) -> list[tuple[Path, dict, dict]]:
    """(run dir, its config, its result) of every engine run (``ENGINES``) under ``root``."""
    runs = []
    for cfg_path in sorted(root.rglob("config.json")):
        result_path = cfg_path.with_name("result.json")
        if not result_path.is_file():
            continue
        try:
            cfg = json.loads(cfg_path.read_text())
            result = json.loads(result_path.read_text())
        except (OSError, ValueError) as err:
            raise InputError(f"{cfg_path.parent}: unreadable run ({one_line(err)})") from None
        if (cfg.get("backend") or {}).get("name") not in ENGINES:
            continue
        runs.append((cfg_path.parent, cfg, result))
    if not runs:
        raise InputError(f"{root}: no engine run ({' or '.join(ENGINES)}: config.json beside "
                         "result.json)")
    return runs


def repeat_groups(runs: list[tuple[Path, dict, dict]]) -> dict[str, list[tuple[Path, dict, dict]]]:
    """The runs by configuration: NAME_r1, NAME_r2, ... under NAME (their configurations must
    be one, else they are not repeats), any other run alone under its own name."""
    groups: dict[str, list[tuple[Path, dict, dict]]] = {}
    for one in runs:
        groups.setdefault(REPEAT.sub("", one[0].name), []).append(one)
    for name, group in groups.items():
        first = group[0][1]
        for run_dir, cfg, _ in group[1:]:
            if cfg != first:
                raise InputError(f"{run_dir}: its configuration is not that of "
                                 f"{group[0][0].name}, so it is not a repeat of {name}")
    return groups


def predict(cfg: dict, hardware: dict, overhead: dict, scales: list[float],
            num_blocks: int | None = None) -> dict[str, float]:
    """The mean over ``scales`` of simulated runs of the measured configuration: its policy,
    workload, model and scheduler, on the given profiles (the measured run is not read, but
    for ``num_blocks``: the KV cache vLLM sized from its memory setting)."""
    backend = {**load_conf("backend", "sim"), "time_scale": 1.0}
    if num_blocks is not None:
        backend["num_blocks"] = num_blocks
    sim = {**cfg, "backend": backend, "hardware": hardware, "overhead": overhead,
           "progress": False}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, scale in enumerate(scales):
            sim["backend"] = {**sim["backend"], "time_scale": scale}
            res = run(sim, Path(tmp) / f"ts{i}")
            rows.append({m: _metric(res, m) for m in TARGETS})
    return pd.DataFrame(rows).mean(numeric_only=True).to_dict()


def score(measured: dict | list[dict], predicted: dict) -> list[dict[str, Any]]:
    """Each metric's error against its target; ``measured``: one result, or the results of
    repeats (their mean is scored, and their spread, max - min over the mean, is kept)."""
    results = measured if isinstance(measured, list) else [measured]
    out = []
    for metric, (kind, target) in TARGETS.items():
        values = [_metric(r, metric) for r in results]
        if any(v is None for v in values):
            continue
        m = sum(values) / len(values)
        p = predicted.get(metric)
        if m is None or p is None or (kind == "rel" and not m):
            continue
        if metric == "prefix_cache_hit_rate" and not m and not p:
            continue  # nothing shared, nothing to score
        err = (p - m) / m * 100.0 if kind == "rel" else p - m
        row = {"metric": metric, "measured": m, "predicted": p, "error": err,
               "unit": "%" if kind == "rel" else "points", "target": target,
               "within": abs(err) <= target}
        if len(results) > 1:
            spread = max(values) - min(values)
            row.update(repeats=len(results),
                       spread=spread / m * 100.0 if kind == "rel" else spread)
        out.append(row)
    return out


def validate(root: Path, hardware: str, overhead: str, scales: list[float]) -> pd.DataFrame:
    hw, oh = load_conf("hardware", hardware), load_conf("overhead", overhead)
    rows = []
    for name, group in repeat_groups(measured_runs(root)).items():
        _, cfg, result = group[0]
        blocks = ((result.get("schedlab") or {}).get("num_blocks")
                  if cfg["backend"]["name"] == "vllm" else None)
        predicted = predict(cfg, hw, oh, scales, blocks)
        policy = cfg["policy"]["name"]
        rate = cfg["workload"].get("request_rate")
        measured = [r for _, _, r in group] if len(group) > 1 else result
        for row in score(measured, predicted):
            rows.append({"run": name, "policy": policy, "request_rate": rate, **row})
        print(f"{name}: predicted", flush=True)
    return pd.DataFrame(rows)


def markdown(df: pd.DataFrame, command: str, table: str = "policies") -> str:
    shown = [m for m in TARGETS if m in set(df["metric"])]
    lines = [f"# {TITLES[table]}", "",
             f"Generated by `{command}`. Errors: (predicted - measured) / measured; SLO "
             "attainment and the prefix cache hit rate in points; targets: request throughput "
             "3%, median TTFT and TPOT 10%, p90 TTFT and TPOT 15%, attainment 5 points, hit "
             "rate 1 point. A miss is marked **bold**.", "",
             "| run | " + " | ".join(shown) + " |", "|---|" + "---|" * len(shown)]
    for run_name, sub in df.groupby("run", sort=True):
        cells = []
        for metric in shown:
            hit = sub[sub["metric"] == metric]
            if hit.empty:
                cells.append("")
                continue
            r = hit.iloc[0]
            unit = "%" if r["unit"] == "%" else " pt"
            text = f"{r['error']:+.1f}{unit}"
            spread = r.get("spread")
            if spread is None or spread != spread:  # one run: no spread
                cells.append(text if r["within"] else f"**{text}**")
                continue
            text += f" ({spread:.1f}{unit})"
            cells.append(text if r["within"] else f"*{text}*"
                         if abs(r["error"]) <= r["target"] + spread else f"**{text}**")
        lines.append(f"| {run_name} | " + " | ".join(cells) + " |")
    n, ok = len(df), int(df["within"].sum())
    if "spread" not in df or df["spread"].isna().all():
        lines += ["", f"{ok} of {n} cells within target."]
        return "\n".join(lines) + "\n"
    spread_ok = int((~df["within"] & (df["error"].abs() <= df["target"] + df["spread"])).sum())
    lo, hi = int(df["repeats"].min()), int(df["repeats"].max())
    lines += ["", f"Each cell: the error of the mean of {lo if lo == hi else f'{lo}-{hi}'} "
              "repeats, and in brackets the repeats' spread (max - min, over the mean for a "
              "relative error); *italic*: over target but within target + spread.", "",
              f"{ok} of {n} cells within target; {spread_ok} more within target + spread."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("measured_dir", help="the runs of benchmarks/policy_suite.py, "
                    "prefix_suite.py or vllm_suite.py")
    ap.add_argument("--out", default=None, help="write TABLE.csv and TABLE.md here")
    ap.add_argument("--table", default="policies", choices=sorted(TITLES),
                    help="the table's name and title (default: policies)")
    ap.add_argument("--hardware", default="h200_calibrated", help="GPU profile (conf/hardware)")
    ap.add_argument("--overhead", default="schedlab_h200", help="CPU profile (conf/overhead)")
    ap.add_argument("--sim-repeats", type=int, default=9,
                    help="simulated runs per configuration, time scales evenly over 1 +- 0.01")
    args = ap.parse_args(argv)
    try:
        root = Path(args.measured_dir)
        if not root.is_dir():
            raise InputError(f"measured_dir: {root} is not a directory")
        df = validate(root, args.hardware, args.overhead, time_scales(args.sim_repeats, 0.01))
        print(df.to_string(index=False))
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            command = "python -m experiments.validate_policies " + " ".join(argv or sys.argv[1:])
            write_text_atomic(out / f"{args.table}.csv", df.to_csv(index=False))
            write_table_markdown(out / f"{args.table}.md", markdown(df, command, args.table))
    except InputError as err:
        print(f"error: {err.message}", file=sys.stderr)
        sys.exit(2)
    except ValueError as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        sys.exit(2)
    return df


if __name__ == "__main__":
    main()
