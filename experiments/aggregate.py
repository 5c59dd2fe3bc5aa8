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
from typing import TYPE_CHECKING, Any

import numpy as np
from hydra.experimental.callback import Callback

from experiments.files import atomic_path
from experiments.labels import SLO_COLUMNS
from experiments.run_dir import AGGREGATE_FILES, record
from experiments.scheduling_metrics import class_columns

if TYPE_CHECKING:  # pandas is imported where a table is made: every run loads this callback
    import pandas as pd

SUMMARY_KEYS = ["completed", "duration", "total_input_tokens", "total_output_tokens",
                "request_throughput", "request_goodput", "output_throughput",
                "total_token_throughput"]
LATENCY_KEYS = [f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
                for stat in ("mean", "median", "std", "p99")]
# experiments/scheduling_metrics.py's run-wide metrics; per SLO class: "<class>.<metric>" columns
SCHEDULING_KEYS = ["class_goodput", "max_queueing_delay_ms", "mean_slowdown", "p99_slowdown",
                   "jain_fairness_slowdown"]
# percentiles chosen beyond p99 (metrics.metric_percentiles, --metric-percentiles)
_PERCENTILE_KEY = re.compile(r"p[0-9.]+_(ttft|tpot|itl|e2el)_ms")
SCHEDLAB_KEYS = ["backend", "policy", "k", "overlap", "tensor_parallel_size", "model", "hardware",
                 "overhead", "wall_seconds",
                 "num_blocks",
                 "num_invocations", "num_preemptions", "num_wasted_steps", "gpu_busy_fraction",
                 "simulated_seconds_per_wall_second", "time_scale", "config_sha256",
                 "prefix_cache_hit_rate",
                 "router", "num_replicas",  # a cluster's (cluster.num_replicas, router)
                 "layout"]  # a disaggregated cluster's pools ("1 prefill + 1 decode")


# Settings a row holds as text, and as numbers (JSON numbers; None where not recorded).
TEXT_KEYS = frozenset({"backend", "policy", "model", "hardware", "overhead", "config_sha256",
                       "workload", "router", "layout", "spec_method", "spec_policy",
                       "spec_draft_model", "acceptance"})
# speculative decoding's metrics (vLLM's names; a run with speculation on has them); the
# per-position acceptance rates become one column a position, "<metric>.<position>" from 0
SPEC_KEYS = ["spec_decode_num_drafts", "spec_decode_draft_tokens", "spec_decode_accepted_tokens",
             "spec_decode_acceptance_rate", "spec_decode_acceptance_length"]
SPEC_POSITIONS = "spec_decode_per_position_acceptance_rate"
# An integer beyond int64 fits no table column (parquet, numpy) and is no count or time anyway.
MAX_INT = 2**63 - 1
# How metrics.py writes a number that is not finite (JSON has none).
_NOT_FINITE = {"nan": math.nan, "inf": math.inf, ".inf": math.inf, "-inf": -math.inf}


class UnreadableFile(ValueError):
    """A JSON file that cannot be read as JSON; ``reason`` says why, without the path."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def read_json(path: Path) -> Any:
    """The JSON value of a result (or any) file; every way it can fail is an UnreadableFile
    naming it: invalid JSON or UTF-8, an integer past Python's 4,300 digits, nesting too deep
    for the parser."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise UnreadableFile(path, f"not valid JSON ({err.msg} at line {err.lineno})") from None
    except UnicodeDecodeError:
        raise UnreadableFile(path, "not UTF-8 text") from None
    except RecursionError:
        raise UnreadableFile(path, "not a result: JSON nested too deep to read") from None
    except ValueError as err:  # "Exceeds the limit (4300 digits) for integer string conversion"
        raise UnreadableFile(path, f"not a result: a number too long to read "
                                   f"({str(err).partition(':')[0]})") from None
    except OSError as err:
        raise UnreadableFile(path, f"cannot be read ({err.strerror or err})") from None


def parse_rate(rate: str | float) -> float:
    """A request rate as written in configs and result files: a number, or inf / .inf."""
    if isinstance(rate, bool):  # true is no rate, though float(True) is 1.0
        raise ValueError(f"request_rate must be a number or inf, got {rate!r}")
    if isinstance(rate, str) and rate.strip().lower() in ("inf", ".inf"):
        return math.inf
    return float(rate)


def check_row(row: dict[str, Any]) -> None:
    """Refuse a row whose values no table column can hold: a list or mapping where a setting
    goes, text where a number goes, an integer beyond int64, text that is not UTF-8. The
    "nan" and "inf" a result writes for a number that is not finite become floats."""
    for key, v in row.items():
        if v is None or (key == "overlap" and isinstance(v, bool)):
            continue
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"{key} holds text that is not UTF-8 (a lone surrogate)"
                                 ) from None
            if key in TEXT_KEYS or key == "run_dir":
                continue
            if v.strip().lower() in _NOT_FINITE:
                row[key] = _NOT_FINITE[v.strip().lower()]
                continue
            raise ValueError(f"{key} must be a number, got {short_repr(v)}")
        if key in TEXT_KEYS:
            raise ValueError(f"{key} must be text, got {short_repr(v)}")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{key} must be a number, got {short_repr(v)}")
        if isinstance(v, int) and abs(v) > MAX_INT:
            raise ValueError(f"{key} must be below 2**63, got an integer of {len(str(v))} "
                             "digits")


def short_repr(v: Any) -> str:
    """A value for an error message: its type where it is a container, else its first 40
    characters (a result may hold a megabyte where a name goes)."""
    if isinstance(v, (list, dict)):
        return f"a JSON {'array' if isinstance(v, list) else 'object'}"
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


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
        row.update({k: result[k] for k in SCHEDULING_KEYS if k in result})
        if isinstance(ext.get("classes"), dict):
            row.update(class_columns(ext["classes"]))
        if isinstance(ext.get("spec"), dict):
            row.update(spec_columns(ext))
        if row["overlap"] is None:  # older results keep it only among the policy's settings
            row["overlap"] = bool((ext.get("policy_settings") or {}).get("overlap", False))
        if row["tensor_parallel_size"] is None:  # results from before the setting: one GPU
            row["tensor_parallel_size"] = 1
        if row["num_replicas"] is None:  # a run of one engine records no cluster
            row["num_replicas"] = 1
        slos = ext.get("goodput_slo_ms")
        if isinstance(slos, dict):
            row.update({SLO_COLUMNS[m]: v for m, v in slos.items() if m in SLO_COLUMNS})
        wl = ext.get("workload") or {}
        row.update(workload=wl.get("kind"), request_rate=wl.get("request_rate"),
                   burstiness=wl.get("burstiness"), max_concurrency=wl.get("max_concurrency"),
                   num_prompts=wl.get("num_prompts"), seed=wl.get("seed"))
    rate = row.get("request_rate")
    if isinstance(rate, (list, dict)):
        raise ValueError(f"request_rate must be a number or inf, got {short_repr(rate)}")
    row["request_rate"] = parse_rate(rate) if rate is not None else None
    row["offered_rate"] = offered_rate(result, row)
    row["run_dir"] = str(path.parent)
    return row


def spec_columns(ext: dict[str, Any]) -> dict[str, Any]:
    """A speculative decoding run's columns: its method, policy, draft model, speculation
    length and acceptance setting, and its spec_decode_* metrics."""
    spec = ext["spec"]
    policy = spec.get("policy")
    out = {"spec_method": spec.get("method"),
           "spec_policy": policy.get("name") if isinstance(policy, dict) else policy,
           "spec_draft_model": spec.get("draft_model"), "spec_num_tokens": spec.get("num_tokens"),
           "acceptance": spec.get("acceptance")}
    out.update({k: ext.get(k) for k in SPEC_KEYS})
    rates = ext.get(SPEC_POSITIONS)
    if isinstance(rates, list):
        out.update({f"{SPEC_POSITIONS}.{i}": r for i, r in enumerate(rates)})
    return out


def offered_rate(result: dict[str, Any], row: dict[str, Any]) -> float | None:
    """Requests sent per second, (sent - 1) / (last send - first send), from the send times
    result.json keeps (``start_times``: ours, vllm bench serve's --save-detailed); inf where
    all were sent at once. Without them, the configured request_rate where it counts requests
    (a conversation workload's counts conversations, whose later turns wait for answers; a
    trace has none)."""
    starts = result.get("start_times")
    if starts is None:
        return None if row.get("workload") == "sharegpt_multiturn" else row["request_rate"]
    if isinstance(starts, (str, dict)):
        raise ValueError(f"start_times must be a list of send times, got {short_repr(starts)}")
    try:
        t = np.fromiter(starts, float)
    except (TypeError, ValueError):
        raise ValueError("start_times must be a list of numbers (send times in seconds)"
                         ) from None
    if len(t) < 2 or not np.isfinite(t).all():
        return None
    span = float(t.max() - t.min())
    return (len(t) - 1) / span if span > 0 else math.inf


def collect(root: str | os.PathLike) -> pd.DataFrame:
    import pandas as pd

    return pd.DataFrame([read_row(p) for p in sorted(Path(root).rglob("result.json"))])


def read_row(path: Path) -> dict[str, Any]:
    """The checked table row of one result.json; a file that is none is a ValueError naming
    it (UnreadableFile where it is not JSON at all)."""
    res = read_json(path)
    if not isinstance(res, dict) or "request_throughput" not in res:
        raise ValueError(f"{path}: not a benchmark result (no request_throughput)")
    try:
        row = row_of(res, path)
        check_row(row)
    except (ValueError, TypeError, AttributeError, OverflowError) as err:
        raise ValueError(f"{path}: not a benchmark result ({err})") from None
    return row


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
        # recorded as schedlab's, so a sweep into this directory later replaces them
        record(args.root, [n for n in AGGREGATE_FILES if (Path(args.root) / n).is_file()])
    except (ValueError, OSError) as err:  # an unreadable result, an unwritable directory
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"aggregated {len(df)} runs -> {Path(args.root) / 'aggregate.csv'}")


if __name__ == "__main__":
    main()
