"""One table (CSV and parquet) from a directory tree of result.json files; the multirun callback."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import pandas as pd
from hydra.experimental.callback import Callback

from experiments.files import atomic_path

SUMMARY_KEYS = ["completed", "duration", "total_input_tokens", "total_output_tokens",
                "request_throughput", "request_goodput", "output_throughput",
                "total_token_throughput"]
LATENCY_KEYS = [f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
                for stat in ("mean", "median", "std", "p99")]
# percentiles chosen beyond p99 (metrics.metric_percentiles, --metric-percentiles)
_PERCENTILE_KEY = re.compile(r"p[0-9.]+_(ttft|tpot|itl|e2el)_ms")
SCHEDLAB_KEYS = ["backend", "policy", "k", "overlap", "tensor_parallel_size", "model", "hardware",
                 "overhead", "wall_seconds",
                 "num_blocks",
                 "num_invocations", "num_preemptions", "num_wasted_steps", "gpu_busy_fraction",
                 "simulated_seconds_per_wall_second", "time_scale", "config_sha256"]


def parse_rate(rate: str | float) -> float:
    """A request rate as written in configs and result files: a number, or inf / .inf."""
    if isinstance(rate, str) and rate.strip().lower() in ("inf", ".inf"):
        return math.inf
    return float(rate)


def row_of(result: dict[str, Any], path: Path) -> dict[str, Any]:
    """The flat table row of one result.json (ours, or a plain vLLM --save-result file)."""
    row: dict[str, Any] = {k: result.get(k) for k in SUMMARY_KEYS + LATENCY_KEYS}
    row.update({k: v for k, v in result.items() if _PERCENTILE_KEY.fullmatch(k)})
    ext = result.get("schedlab")
    if ext is None:  # a vLLM benchmark_serving file: what it says about itself
        row.update(backend="vllm", policy=result.get("policy"), k=result.get("num_scheduler_steps"),
                   model=result.get("model_id"), request_rate=result.get("request_rate"),
                   burstiness=result.get("burstiness"),
                   max_concurrency=result.get("max_concurrency"),
                   num_prompts=result.get("num_prompts") or result.get("completed"))
        if row["request_goodput"] is None:  # vLLM (v0.6.4 on) spells the key with a colon
            row["request_goodput"] = result.get("request_goodput:")
    else:
        row.update({k: ext.get(k) for k in SCHEDLAB_KEYS})
        if row["overlap"] is None:  # older results keep it only among the policy's settings
            row["overlap"] = bool((ext.get("policy_settings") or {}).get("overlap", False))
        if row["tensor_parallel_size"] is None:  # results from before the setting: one GPU
            row["tensor_parallel_size"] = 1
        wl = ext.get("workload") or {}
        row.update(workload=wl.get("kind"), request_rate=wl.get("request_rate"),
                   burstiness=wl.get("burstiness"), max_concurrency=wl.get("max_concurrency"),
                   num_prompts=wl.get("num_prompts"), seed=wl.get("seed"))
    rate = row.get("request_rate")
    row["request_rate"] = parse_rate(rate) if rate is not None else None
    row["run_dir"] = str(path.parent)
    return row


def collect(root: str | os.PathLike) -> pd.DataFrame:
    paths = sorted(Path(root).rglob("result.json"))
    rows = []
    for p in paths:
        try:
            res = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{p}: not valid JSON ({err.msg} at line {err.lineno})") from None
        except UnicodeDecodeError:
            raise ValueError(f"{p}: not a text file") from None
        except OSError as err:
            raise ValueError(f"{p}: cannot be read ({err.strerror})") from None
        if not isinstance(res, dict) or "request_throughput" not in res:
            raise ValueError(f"{p}: not a benchmark result (no request_throughput)")
        try:
            rows.append(row_of(res, p))
        except (ValueError, TypeError, AttributeError) as err:  # e.g. request_rate "fast"
            raise ValueError(f"{p}: not a benchmark result ({err})") from None
    return pd.DataFrame(rows)


TABLES = ("aggregate.csv", "aggregate.parquet")


def remove_tables(root: Path) -> None:
    for name in TABLES:
        (root / name).unlink(missing_ok=True)


def write_tables(df: pd.DataFrame, root: Path) -> None:
    """ROOT/aggregate.csv and ROOT/aggregate.parquet as a pair: both are rendered to temporary
    files and renamed together; if anything fails neither is left, so they never disagree."""
    try:
        with atomic_path(root / TABLES[0]) as csv, atomic_path(root / TABLES[1]) as parquet:
            df.to_csv(csv, index=False)
            df.to_parquet(parquet, index=False)
    except BaseException:
        with contextlib.suppress(OSError):  # the write's own error is the one to report
            remove_tables(root)
        raise


def one_row_per_simulated_config(df: pd.DataFrame) -> pd.DataFrame:
    """Simulated runs of one configuration (equal config stamps: a sweep that spelled a setting
    two ways, say policy=multi_step and the default) give the same result, so one row stands
    for them and the others are named; measured repeats of one configuration all stay, as
    each is a draw of its own."""
    if "config_sha256" not in df or "backend" not in df:
        return df
    sim = (df["backend"] == "sim") & df["config_sha256"].notna()
    dup = sim & df.duplicated("config_sha256", keep="first")
    for run_dir in df.loc[dup, "run_dir"]:
        print(f"aggregate: {run_dir} repeats the configuration of another simulated run; "
              "one row kept")
    return df[~dup].reset_index(drop=True)


def aggregate(root: str | os.PathLike) -> pd.DataFrame:
    """Write ROOT/aggregate.csv and ROOT/aggregate.parquet from every result.json below ROOT.
    If a result cannot be read, the error names it and the old tables are removed: a table
    that no longer matches the results below it is never left in place."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"{root} is not a directory")
    try:
        df = collect(root)
        if df.empty:
            raise ValueError(f"no result.json below {root}")
    except BaseException:
        with contextlib.suppress(OSError):
            remove_tables(root)
        raise
    df = one_row_per_simulated_config(df)
    sort = [c for c in ("backend", "model", "hardware", "policy", "request_rate", "k") if c in df]
    df = df.sort_values(sort, kind="stable", na_position="last").reset_index(drop=True)
    write_tables(df, root)
    return df


class AggregateCallback(Callback):
    """Ends every multirun with one aggregated table in the sweep directory."""

    def on_multirun_end(self, config, **kwargs) -> None:
        root = Path(config.hydra.sweep.dir)
        try:
            df = aggregate(root)
        except (ValueError, OSError) as err:
            # Hydra turns a callback's exception into a warning and exits 0; the sweep's
            # table is its result, so failing to write it fails the command.
            print(f"error: aggregating the sweep: {err}", file=sys.stderr)
            sys.exit(2)
        print(f"aggregated {len(df)} runs -> {root / 'aggregate.csv'} (and .parquet)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("root", help="directory searched recursively for result.json files")
    args = ap.parse_args()
    try:
        df = aggregate(args.root)
    except (ValueError, OSError) as err:  # an unreadable result, an unwritable directory
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"aggregated {len(df)} runs -> {Path(args.root) / 'aggregate.csv'}")


if __name__ == "__main__":
    main()
