"""The operator-table GPU profile: its tables measured on the GPU, its two served-vs-isolated
factors fitted on served t=0 windows, the profile written.

    python -m experiments.calibrate --ops                       # GPU: tables, fit, profile
    python -m experiments.calibrate --ops --data conf/calibration/h200_ops   # CPU: refit

The tables (``benchmarks/operators.py``: GEMMs, paged attention, small per-layer kernels,
sampler, CUDA-graph replay against layer count, over every conf/model shape) go to the conf
dir's ``calibration/<name>/``; a model's step costs are computed from them and never fitted to
that model. On top of them the profile carries ``op_kernel_factor`` and ``op_compute_factor``,
fitted on the served t=0 windows of every model of the leave-one-model-out spec (``--spec``;
default: the H200 runs in docs/validation/measured) as ``experiments.leave_one_out`` fits each
of its folds. Refitting the same tables and runs gives the same profile.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import scipy

from common.step_sizes import DECODE_GRAPH_SIZES, PIECEWISE_GRAPH_TOKENS, PREFILL_GRAPH_TOKENS
from experiments import leave_one_out as loo
from experiments import model_runs
from experiments.profiles import InputError, load_profile, write_yaml
from simulator.op_tables import CONF_DIR as TABLES_ROOT  # where a relative op_tables points

ROOT = Path(__file__).resolve().parents[1]
# a fit that misses a model's summed GPU time by more than this, or a factor at its bound, is
# flagged: the tables do not price that model's served steps (a short --budget-s thins them)
FIT_WARN = 0.05
DATASHEET = ("peak_tflops", "hbm_gib", "hbm_tbps", "nvlink_gbps", "allreduce_efficiency",
             "allreduce_latency_us", "p2p_latency_us", "activation_reserve_gib")


def tables_path(root: Path) -> str:
    """``op_tables`` as the profile names it: relative to conf/ (where the simulator resolves a
    relative path) when the tables are there, else absolute."""
    try:
        return str(root.resolve().relative_to(TABLES_ROOT.resolve()))
    except ValueError:
        return str(root.resolve())


def tables_digest(root: Path) -> str:
    """A digest of the tables' contents: the fit's cached simulations are kept per digest, so
    that tables measured again at the same path are never priced from stale runs."""
    h = hashlib.sha256()
    for f in sorted(root.glob("*.csv")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def check_name(name: str, conf: Path) -> None:
    """A plain file name, and no existing hardware profile other than an operator-table one."""
    if not re.fullmatch(r"[\w.-]+", name) or name in (".", ".."):
        raise InputError(f"--name {name!r}: not a plain profile name (letters, digits, _ . -)")
    path = conf / "hardware" / f"{name}.yaml"
    if path.exists() and "op_tables:" not in path.read_text():
        raise InputError(f"--name {name}: {path} exists and is not an operator-table profile")


def measure_tables(out: Path, budget_s: float) -> None:
    """benchmarks/operators.py over every conf/model shape into ``out`` (GPU)."""
    if out.exists() and any(out.iterdir()):
        raise InputError(f"--name: {out} already holds tables; refit them with --data {out}, "
                         "or give another --name")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "operators.py"), str(out),
           "--budget-s", f"{budget_s:g}"]
    if subprocess.run(cmd, cwd=ROOT).returncode != 0:
        raise InputError(f"{' '.join(cmd[1:])} failed (its output above says why)")


def ops_profile(tables: str, name: str, base: dict[str, Any], num_sms: int) -> dict[str, Any]:
    """The profile at unit factors: ``base``'s datasheet numbers, the tables and their GPU's
    SM count, and the engine's CUDA-graph settings (decode batches, prefill-only and piecewise
    steps)."""
    return {"name": name, **{k: base[k] for k in DATASHEET if k in base}, "num_sms": num_sms,
            "cuda_graph_max_batch": max(DECODE_GRAPH_SIZES),
            "prefill_graph_max_tokens": max(PREFILL_GRAPH_TOKENS),
            "piecewise_graph_max_tokens": max(PIECEWISE_GRAPH_TOKENS),
            "op_tables": tables, "op_kernel_factor": 1.0, "op_compute_factor": 1.0}


def fit(profile: dict[str, Any], spec: list[model_runs.ModelRuns], work: Path,
        ) -> tuple[dict[str, Any], pd.DataFrame]:
    """The profile with its two factors fitted on every spec model's served t=0 windows, and
    the windows' rows (model, config, measured GPU time g and its simulated parts)."""
    rows = loo.spec_factor_rows(spec, {r.model: model_runs.measured_configs(r) for r in spec}, profile,
                                load_profile("overhead", "schedlab_h200"), work)
    kf, cf = loo.fit_factors(rows)
    return {**profile, "op_kernel_factor": kf, "op_compute_factor": cf}, rows


def tables_meta(root: Path) -> tuple[str, int]:
    """Where and when the tables were measured (from their meta files), and the GPU's SMs."""
    metas = []
    for f in sorted(root.glob("*.meta.json")):
        try:
            metas.append(json.loads(f.read_text()))
        except (OSError, ValueError) as err:
            raise InputError(f"{f}: not a table's meta file ({err})") from None
    if not metas:
        raise InputError(f"--data {root}: no operator tables (*.meta.json beside each CSV)")
    dates = sorted({str(m.get("date_utc", "?"))[:10] for m in metas})
    gpus = sorted({str(m.get("gpu_name", "?")) for m in metas})
    sms = {int(m["num_sms"]) for m in metas if "num_sms" in m}
    if len(sms) > 1:
        raise InputError(f"--data {root}: tables of GPUs with {sorted(sms)} SMs mixed")
    if not sms:
        raise InputError(f"--data {root}: its meta files name no num_sms (the GPU's SM count)")
    return f"{', '.join(gpus)}, {', '.join(dates)}", sms.pop()


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """``python -m experiments.calibrate --ops`` (calibrate.py parses the flags)."""
    conf = Path(args.conf_dir)
    name = args.name
    check_name(name, conf)
    base = load_profile("hardware", args.base_hardware or "h200")  # checked before measuring
    spec = model_runs.load_spec(args.spec)
    if args.data:
        root = Path(args.data)
        if not root.is_dir():
            raise InputError(f"--data {args.data}: not a directory of operator tables")
    else:
        root = conf / "calibration" / name
        measure_tables(root, args.budget_s)
    where, num_sms = tables_meta(root)
    tables = tables_path(root)
    work = Path(args.runs) / f"ops_{tables_digest(root)}"
    profile, rows = fit(ops_profile(tables, name, base, num_sms), spec, work)
    kf, cf = profile["op_kernel_factor"], profile["op_compute_factor"]
    err = loo.factor_fit_error(rows, kf, cf)
    warning = ""
    lo, hi = loo.FACTOR_BOUNDS
    if err.abs().max() > FIT_WARN or kf in (lo, hi) or cf <= 1.0 or cf >= hi:
        warning = (f"WARNING: the fit misses a model's summed GPU time by {err.abs().max():.1%}"
                   f" (factors {kf:g}, {cf:g}; bounds {lo:g}-{hi:g}, op_compute_factor >= 1): "
                   "check the tables, whose grids a short --budget-s thins")
        print(warning, file=sys.stderr)
    command = "python -m experiments.calibrate " + " ".join(a for a in argv if a)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = (
        f"Calibrated by `{command}` on {stamp}\n"
        f"(numpy {np.__version__}, scipy {scipy.__version__}, pandas {pd.__version__}).\n"
        f"Every step priced from the operator tables in {tables} ({where};\n"
        "simulator/op_cost.py), over every conf/model shape, so the profile holds for any\n"
        "Llama-family shape. The two served-vs-isolated factors are fitted by least squares on\n"
        f"{len(rows)} served t=0 windows of {', '.join(sorted(set(rows['model'])))}\n"
        "(experiments.leave_one_out's fit; its table refits them with each model held out).\n"
        f"Datasheet numbers from {base['name']}; the efficiencies and fixed times of cost_model.py\n"
        "are unused. Summed GPU time of the fitted windows, fit against measured:\n"
        + "\n".join(f"  {m}: {e:+.1%}" for m, e in err.items())
        + (f"\n{warning}" if warning else ""))
    path = conf / "hardware" / f"{name}.yaml"
    write_yaml(path, profile, header)
    print(f"op_kernel_factor {kf:g}, op_compute_factor {cf:g} over {len(rows)} windows")
    print("\n".join(f"  {m}: summed GPU time {e:+.1%}" for m, e in err.items()))
    print(f"wrote {path}")
    return profile
