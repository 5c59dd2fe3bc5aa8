"""The measured runs the leave-one-model-out validation reads: each model's runs (the spec),
their configurations, their served windows and their tail latencies."""

from __future__ import annotations

import glob
import gzip
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from experiments.measured import measured_from_dir
from experiments.profiles import InputError, load_conf
from policies import ModelSpec

ROOT = Path(__file__).resolve().parents[1]
POLICIES = [("single_step", None), ("multi_step", 8), ("cp1", 8)]
# a window after which the GPU idled longer than this many times its timed CPU phases waited
# for arrivals: its CPU cost is read from the timed phases
IDLE_FACTOR = 2.0
IDLE_MARGIN_S = 200e-6
TAIL_PERCENTILES = (90, 99)

@dataclass(frozen=True)
class ModelRuns:
    """Where one model's measured runs are and how they were run."""

    model: str
    dirs: list[str]  # result.json trees (t=0 and Poisson), read by experiments.measured
    rate: float | None  # its Poisson rate (req/s) in the table; None: every measured rate
    steps: dict[str, str] = field(default_factory=dict)  # "policy_kK" -> t=0 steps.csv
    poisson_steps: list[str] = field(default_factory=list)  # Poisson runs' steps.csv files
    overrides: list[str] = field(default_factory=list)  # the runs' scheduler settings


def _model_dir(name: str, rate: float | None, overrides: list[str] | None = None,
               root: str = "docs/validation/measured/models") -> ModelRuns:
    base = f"{root}/{name}"
    return ModelRuns(name, [f"{base}/t0", f"{base}/poisson"], rate,
                     {tag: f"{base}/t0/{tag}/steps.csv.gz"
                      for tag in ("single_step_k1", "multi_step_k8", "cp1_k8")},
                     [f"{base}/poisson/*/steps.csv.gz"], overrides or [])


DEFAULT_SPEC = [
    # max_model_len 131072: the runs capped a step at 8192 tokens
    _model_dir("llama3_2_1b", 79, ["scheduler.max_num_batched_tokens=8192"]),
    _model_dir("llama3_2_3b", 44),
    # t=0: the 8B validation grid's runs (two repeats each); Poisson: 28 req/s, ~60% of capacity
    ModelRuns("llama3_8b", ["docs/validation/measured/grid",
                            "docs/validation/measured/models/llama3_8b/poisson"],
              28, {tag: f"docs/validation/measured/steps/{tag}.steps.csv"
                   for tag in ("single_step_k1", "multi_step_k8", "cp1_k8")},
              ["docs/validation/measured/models/llama3_8b/poisson/*/steps.csv.gz"]),
    _model_dir("llama2_13b", 14),
    # measured after every method choice of this module was made (see docs/validation/models.md)
    _model_dir("llama_30b", 6),
]


def load_spec(path: str | None) -> list[ModelRuns]:
    """The built-in spec, or a YAML list of ModelRuns mappings (paths relative to the file)."""
    if path is None:
        return [_rooted(r, ROOT) for r in DEFAULT_SPEC]
    f = Path(path)
    try:
        items = yaml.safe_load(f.read_text())
        runs = [ModelRuns(**item) for item in items]
    except (OSError, yaml.YAMLError, TypeError) as err:
        raise InputError(f"--spec {path}: not a list of model runs ({err})") from None
    return [_rooted(r, f.parent) for r in runs]


def run_scheduler_settings(model_dir: Path) -> list[str] | None:
    """The scheduler settings the runs under ``model_dir`` were measured with, as overrides,
    from their config.json files (None: there are none); runs measured with different settings
    are refused, as one ModelRuns carries one set."""
    found = {}
    for f in sorted(model_dir.rglob("config.json")):
        try:
            found[f] = json.dumps(json.loads(f.read_text())["scheduler"], sort_keys=True)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise InputError(f"{f}: not a run's config (no scheduler settings: {err})") from None
    if not found:
        return None
    if len(set(found.values())) > 1:
        raise InputError(f"--predict: the runs under {model_dir} were measured with different "
                         "scheduler settings; predict them from separate directories")
    settings = json.loads(next(iter(found.values())))
    return [f"scheduler.{k}={'null' if v is None else v}" for k, v in sorted(settings.items())]


def predicted_runs(root: str, spec: list[ModelRuns]) -> list[ModelRuns]:
    """--predict ROOT: one ModelRuns per model directory ROOT/MODEL (its t0/ and poisson/ trees,
    as under docs/validation/measured/models), at every measured rate, with the scheduler
    settings of the runs' own config.json files, else those of the spec's runs of that
    model."""
    base = Path(root)
    if not base.is_dir():
        raise InputError(f"--predict {root}: not a directory")
    known = {r.model: r for r in spec}
    out = []
    for d in sorted(p for p in base.iterdir() if p.is_dir()):
        try:
            _model_spec(d.name)
        except ValueError:
            raise InputError(f"--predict {root}: {d.name} is not a conf/model name") from None
        own = run_scheduler_settings(d)
        r = _model_dir(d.name, None, own if own is not None else
                       known[d.name].overrides if d.name in known else [], root=str(base))
        out.append(ModelRuns(r.model, [x for x in r.dirs if Path(x).is_dir()], None,
                             {t: f for t, f in r.steps.items() if Path(f).is_file()},
                             r.poisson_steps, r.overrides))
    if not out:
        raise InputError(f"--predict {root}: no model directories (ROOT/MODEL/t0, ROOT/MODEL/"
                         "poisson)")
    return out


def _rooted(r: ModelRuns, base: Path) -> ModelRuns:
    def p(s: str) -> str:
        return str(base / s)

    return ModelRuns(r.model, [p(d) for d in r.dirs], None if r.rate is None else float(r.rate),
                     {k: p(v) for k, v in r.steps.items()}, [p(g) for g in r.poisson_steps],
                     list(r.overrides))


def config_tag(policy: str, k: int | None) -> str:
    return f"{policy}_k{k or 1}"


def _model_spec(name: str) -> ModelSpec:
    return ModelSpec.from_dict(load_conf("model", name))


def read_steps(path: Path) -> pd.DataFrame:
    try:
        return pd.read_csv(path)
    except (OSError, ValueError) as err:
        raise InputError(f"{path}: cannot read steps ({err})") from None


def measured_configs(runs: ModelRuns) -> dict[tuple, dict[str, Any]]:
    """(policy, k, rate) -> the measurement (repeats averaged), for the table's configurations."""
    out = {}
    for d in runs.dirs:
        if not Path(d).is_dir():
            raise InputError(f"{runs.model}: measured directory {d} does not exist")
        try:
            found = measured_from_dir(Path(d))
        except ValueError as err:
            raise InputError(f"{runs.model}: {err}") from None
        for (policy, k, rate), meas in found.items():
            if (policy, k) in POLICIES and (math.isinf(rate) or runs.rate in (None, rate)):
                out[(policy, k, rate)] = meas
    if not out:
        raise InputError(f"{runs.model}: no measured single_step, multi_step k=8 or cp1 k=8 run "
                         f"in {', '.join(runs.dirs)}")
    return out


def window_gaps(s: pd.DataFrame) -> pd.Series:
    """The GPU's idle time after each window: the next window's start less this one's start and
    GPU time (NaN after the last)."""
    return s["t_start"].shift(-1) - s["t_start"] - s["gpu_s"]


def served_windows(runs: ModelRuns) -> pd.DataFrame:
    """Every measured served window of the model (t=0 and Poisson): fit_overhead's rows."""
    files = [Path(p) for p in runs.steps.values()]
    for pattern in runs.poisson_steps:
        files += [Path(p) for p in sorted(glob.glob(pattern))]
    if not files:
        raise InputError(f"{runs.model}: no steps file (steps.csv.gz) of its runs in "
                         + ", ".join(runs.dirs))
    frames = []
    for f in files:
        s = read_steps(f)
        gap = window_gaps(s)
        cpu = s["schedule_s"] + s["prepare_s"] + s["update_s"]
        timed = cpu + s["launch_s"] + s["pythonize_s"]
        gap = gap.where(gap <= IDLE_FACTOR * timed + IDLE_MARGIN_S)  # idle: waited for arrivals
        frames.append(s.assign(kind="served", cpu_s=cpu, gap_s=gap.clip(lower=0.0),
                               model=runs.model, file=str(f),
                               num_layers=_model_spec(runs.model).num_layers))
    return pd.concat(frames, ignore_index=True)


def tail_latencies(result: Path) -> dict[str, float]:
    """p90 and p99 TTFT and TPOT (ms) of one result.json: the file's own ``pNN_*_ms`` where it
    has them, else from its per-request lists (in the file, as the simulator writes them, or in
    a measured run's ``per_request.json.gz`` beside it) as ``experiments.metrics.summarize``
    computes them: completed requests, TPOT (e2el - ttft) / (output_len - 1) over those with
    more than one output token. NaN where neither is there (result files stripped of their
    lists)."""
    try:
        res = json.loads(result.read_text())
    except (OSError, ValueError) as err:
        raise InputError(f"{result}: cannot read the result ({err})") from None
    keys = [f"p{p}_{m}_ms" for p in TAIL_PERCENTILES for m in ("ttft", "tpot")]
    out = {k: float(res[k]) for k in keys if isinstance(res.get(k), (int, float))}
    if len(out) == len(keys):
        return out
    lists = res if res.get("ttfts") else _per_request(result.parent / "per_request.json.gz")
    if not lists:
        return {k: out.get(k, math.nan) for k in keys}
    done = [e == "" for e in lists.get("errors") or [""] * len(lists["ttfts"])]
    ttft = [t for t, ok in zip(lists["ttfts"], done, strict=True) if ok]
    tpot = [(e - t) / (n - 1) for t, e, n, ok in zip(lists["ttfts"], lists["e2els"],
                                                      lists["output_lens"], done, strict=True)
            if ok and n > 1]
    for p in TAIL_PERCENTILES:
        for name, xs in (("ttft", ttft), ("tpot", tpot)):
            out.setdefault(f"p{p}_{name}_ms", float(np.percentile(xs or [0.0], p)) * 1000)
    return {k: out[k] for k in keys}


def _per_request(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        with gzip.open(path, "rt") as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise InputError(f"{path}: cannot read the per-request lists ({err})") from None


def measured_tails(meas: dict[str, Any]) -> dict[str, float]:
    """A measured configuration's tail latencies: the mean over its repeats' files (as
    ``measured_from_dir`` averages the other metrics); NaN where a repeat has none."""
    per_file = [tail_latencies(Path(f)) for f in meas.get("files") or []]
    if not per_file:
        return {}
    return {k: float(np.mean([t[k] for t in per_file])) for k in per_file[0]}
