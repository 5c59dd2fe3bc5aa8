"""Leave-one-model-out validation: profiles fitted without a model's data predict its served runs.

    python -m experiments.leave_one_out --out docs/validation/models

For each model of the spec (default: llama3_2_1b, llama3_2_3b, llama3_8b, llama2_13b and
llama_30b measured on an H200, ``experiments.model_runs.DEFAULT_SPEC``), the held-out model's
rows are dropped first, then:

1. GPU: ``conf/hardware/h200_ops.yaml`` prices steps from the operator tables, which cover every
   model shape and were never fitted to one; its two served-vs-isolated factors
   (``op_kernel_factor``, ``op_compute_factor``) are fitted on the other models' served t=0
   windows. At t=0 the simulator forms exactly the measured windows (every run checks this), so
   each window's kernel time K and compute-bound share C come from simulated runs at unit and
   doubled factors, and the measured GPU time g ~ G + a K + b C by least squares
   (a = op_kernel_factor, b = a (op_compute_factor - 1); G: the launch terms).
2. CPU: ``experiments.fit_cpu.fit_overhead`` over the other models' served windows pooled as
   measured (their idle time between windows, less the last step's pythonization; a window
   after which the GPU waited for arrivals is read as its timed CPU phases instead).
3. The held-out model's runs (t=0 and its Poisson rate, single_step, multi_step k=8 and cp1 k=8
   where measured) are simulated with the measured KV cache and scheduler settings, as
   ``experiments.validate.predict`` does, and compared on request throughput, median TTFT and
   median TPOT, and on the tails beside them: p90 (target 15%) and p99 (no target) TTFT and
   TPOT. The old profile (h200_calibrated + schedlab_h200, fitted on llama3_8b steps) predicts
   the same runs for comparison.

A prediction reads nothing of the run it predicts but its configuration (workload, scheduler
settings, KV cache size). ``--per-run-host-factor`` is a diagnostic that breaks this rule: it
scales each run's CPU times by its host factor, read from that run's own ``update()`` timings
(``experiments.host_speed``), in the fit and in the prediction; its tables say so in their
title, and no headline number uses them.

``--predict ROOT`` predicts other runs of a model (another host's, say: ROOT/MODEL/t0 and
ROOT/MODEL/poisson) by the fold that holds that model out.

Writes ``OUT.csv`` (model x configuration x metric x profile: predicted, measured, error, and
``host_scaling``: none, or the diagnostic's per-run factor; at t=0 also the run's summed GPU time
and the CPU time between windows, simulated against measured),
``OUT_fit.csv`` (each fold's fitted coefficients, and a fit on every model, held_out "none":
the coefficients of conf/hardware/h200_ops.yaml) and ``OUT.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import math
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.fit_cpu import fit_overhead
from experiments.host_speed import on_reference_host, scaled_overhead, with_host_factors
from experiments.leave_one_out_tables import (
    NEW,
    NO_SCALING,
    OLD,
    PER_RUN,
    TAIL_METRICS,
    TARGET_METRICS,
    markdown,
    write,
)
from experiments.model_runs import (
    ModelRuns,
    config_tag,
    load_spec,
    measured_configs,
    measured_tails,
    predicted_runs,
    read_steps,
    served_windows,
    tail_latencies,
    window_gaps,
)
from experiments.profiles import InputError, load_profile
from experiments.validate import (
    _Parser,
    predict,
    run_one,
    sim_run_dirs,
    time_scales,
    writable_dir,
)

FACTOR_BOUNDS = (0.5, 3.0)  # op_kernel_factor and op_compute_factor stay within these


# ---------------------------------------------------------------------------- host CPU speed
def config_factor(runs: ModelRuns, windows: pd.DataFrame, policy: str, k: int | None,
                  rate: float) -> float:
    """The host factor of the measured run(s) of a configuration (repeats, directories
    ``TAG_rateR_*``: their mean): read from the run being predicted, so the
    ``--per-run-host-factor`` diagnostic's alone."""
    tag = config_tag(policy, k)
    if math.isinf(rate):
        files = [runs.steps[tag]] if tag in runs.steps else []
    else:
        name = re.compile(rf"{re.escape(tag)}_rate{rate:g}(_.*)?")
        files = [f for pattern in runs.poisson_steps for f in sorted(glob.glob(pattern))
                 if name.fullmatch(Path(f).parent.name)]
    mine = windows[windows["file"].isin([str(Path(f)) for f in files])]
    if mine.empty:
        rate_s = "t=0" if math.isinf(rate) else f"{rate:g} req/s"
        raise InputError(f"{runs.model}: no steps file of its {tag} run at {rate_s}; its host "
                         "factor needs the run's update() timings (the default goes without)")
    return float(mine.groupby("file")["host_factor"].first().mean())


# ---------------------------------------------------------------------------- GPU factors
def sim_overrides(runs: ModelRuns, policy: str, k: int | None, rate: float, meas: dict,
                  ) -> list[str]:
    ov = [f"policy={policy}", f"model={runs.model}", "workload=sharegpt",
          f"workload.num_prompts={meas.get('num_prompts') or 1000}",
          f"workload.seed={meas.get('seed') or 0}",
          f"workload.request_rate={'inf' if math.isinf(rate) else rate}", "progress=false",
          "backend=sim", "backend.stream_per_step=true"]
    if k is not None:
        ov.append(f"policy.num_steps={k}")
    return ov + list(runs.overrides)


def factor_rows(runs: ModelRuns, measured: dict[tuple, dict], hw: dict, overhead: dict,
                work: Path) -> pd.DataFrame:
    """The model's t=0 windows: measured GPU time g, and from simulated runs of the same windows
    at unit and doubled factors, the launch part G, kernels K and compute-bound share C."""
    frames = []
    for (policy, k, rate), meas in sorted(measured.items(), key=str):
        tag = config_tag(policy, k)
        if not math.isinf(rate) or tag not in runs.steps:
            continue
        base = sim_overrides(runs, policy, k, rate, meas)
        extra = [f"backend.num_blocks={meas['cache_sizes'][0]}"] if meas["cache_sizes"] else []
        extra.append("metrics.save_per_request=false")  # the fit reads steps.csv only
        gpu = {}
        for name, kf, cf in (("unit", 1.0, 1.0), ("kernel2", 2.0, 1.0), ("compute2", 1.0, 2.0)):
            prof = {**hw, "op_kernel_factor": kf, "op_compute_factor": cf}
            run_dir = work / runs.model / f"{tag}_{name}"
            with contextlib.redirect_stdout(io.StringIO()):  # each run prints its summary
                run_one(base + extra, run_dir, {"hardware": prof, "overhead": overhead})
            gpu[name] = pd.read_csv(run_dir / "steps.csv")
        meas_steps = read_steps(Path(runs.steps[tag]))
        cols = ["k", "num_seqs", "num_tokens", "kv_tokens"]
        sim = gpu["unit"]
        if len(sim) != len(meas_steps) or not (sim[cols].to_numpy()
                                                == meas_steps[cols].to_numpy()).all():
            raise InputError(f"{runs.model} {tag}: the simulator formed other windows than "
                             f"{runs.steps[tag]} measured; the GPU fit needs the same windows")
        K = gpu["kernel2"]["gpu_s"] - sim["gpu_s"]
        frames.append(pd.DataFrame({"model": runs.model, "config": tag,
                                    "g": meas_steps["gpu_s"], "K": K,
                                    "C": gpu["compute2"]["gpu_s"] - sim["gpu_s"],
                                    "G": sim["gpu_s"] - K}))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(
        columns=["model", "config", "g", "K", "C", "G"])


def spec_factor_rows(spec: list[ModelRuns], measured: dict[str, dict], hw: dict, overhead: dict,
                     work: Path) -> pd.DataFrame:
    """``factor_rows`` of every model of ``spec`` (``measured``: each model's configurations)."""
    return pd.concat([factor_rows(r, measured[r.model], hw, overhead, work) for r in spec],
                     ignore_index=True)


def factor_fit_error(rows: pd.DataFrame, kf: float, cf: float) -> pd.Series:
    """Per model, the windows' summed GPU time at factors (kf, cf), G + a K + b C with a = kf
    and b = a (cf - 1) as ``fit_factors`` fits it, against the measured (relative error)."""
    pred = rows["G"] + kf * rows["K"] + kf * (cf - 1.0) * rows["C"]
    by = rows.assign(pred=pred).groupby("model")[["pred", "g"]].sum()
    return by["pred"] / by["g"] - 1.0


def fit_factors(rows: pd.DataFrame) -> tuple[float, float]:
    """(op_kernel_factor, op_compute_factor) from g ~ G + a K + b C by least squares, a and
    1 + b / a within FACTOR_BOUNDS."""
    from scipy.optimize import lsq_linear

    if rows.empty:
        raise InputError("no served t=0 windows of the other models to fit the GPU factors on")
    X = np.column_stack([rows["K"], rows["C"]]).astype(float)
    y = (rows["g"] - rows["G"]).to_numpy(float)
    lo, hi = FACTOR_BOUNDS
    sol = lsq_linear(X, y, bounds=([lo, 0.0], [hi, hi]), method="bvls", tol=1e-12).x
    a, b = float(sol[0]), float(sol[1])
    return round(a, 4), round(min(max(1.0 + b / a, lo), hi), 4)


# ---------------------------------------------------------------------------- folds
def fold_profiles(held_out: str, windows: pd.DataFrame, gpu_rows: pd.DataFrame, hw: dict,
                  ) -> tuple[dict, dict, dict[str, float]]:
    """The hardware and overhead profiles fitted without ``held_out``'s rows, and the fit."""
    others_gpu = gpu_rows[gpu_rows["model"] != held_out]
    others_win = on_reference_host(windows[windows["model"] != held_out])
    kf, cf = fit_factors(others_gpu)
    hw_fold = {**hw, "name": f"h200_ops_without_{held_out}", "op_kernel_factor": kf,
               "op_compute_factor": cf}
    ov, _ = fit_overhead(others_win, f"served_without_{held_out}")
    fit = {"op_kernel_factor": kf, "op_compute_factor": cf,
           **{key: v for key, v in ov.items() if key.endswith("_us")},
           "gpu_windows": len(others_gpu), "cpu_windows": len(others_win),
           "fit_models": ";".join(sorted(set(others_gpu["model"])))}
    return hw_fold, ov, fit


def predict_config(runs: ModelRuns, policy: str, k: int | None, rate: float, meas: dict,
                   profiles: dict, scales: list[float], work: Path, label: str,
                   host_factor: float | None = None) -> list[dict]:
    """One configuration's rows: each metric predicted against measured. ``host_factor``: the
    predicted run's own factor its CPU costs were scaled by (the diagnostic); None: none."""
    tag = f"{config_tag(policy, k)}_rate{'inf' if math.isinf(rate) else f'{rate:g}'}"
    run_dir = work / runs.model / ("new" if label == NEW else "old") / tag
    with contextlib.redirect_stdout(io.StringIO()):  # each run prints its summary
        pred = predict(sim_overrides(runs, policy, k, rate, meas), run_dir, profiles,
                       meas["cache_sizes"], scales)
    sizes = meas["cache_sizes"]
    sim_dirs = sim_run_dirs(run_dir, sizes, sizes[0] if sizes else None, scales)
    split = {}
    if math.isinf(rate) and config_tag(policy, k) in runs.steps:
        split = time_split(read_steps(Path(runs.steps[config_tag(policy, k)])), sim_dirs)
    # the tails, as the medians: the mean over the simulated runs and over the measured repeats
    sim_tails = [tail_latencies(d / "result.json") for d in sim_dirs]
    pred = {**pred, **{m: float(np.mean([t[m] for t in sim_tails])) for m in TAIL_METRICS}}
    meas = {**meas, **measured_tails(meas)}
    rows = []
    for metric, target in {**TARGET_METRICS, **TAIL_METRICS}.items():
        p, q = pred.get(metric, math.nan), meas.get(metric, math.nan)
        err = (p - q) / q if q == q and q and p == p else math.nan
        rows.append({"model": runs.model, "policy": policy, "k": k or 1,
                     "request_rate": rate, "metric": metric, "profile": label,
                     "predicted": p, "measured": q, "rel_error": err,
                     "target": math.nan if target is None else target,
                     "over_target": target is not None and err == err and abs(err) > target,
                     "repeats": meas.get("repeats", 1),
                     "host_scaling": NO_SCALING if host_factor is None else PER_RUN,
                     "host_factor": 1.0 if host_factor is None else round(host_factor, 4),
                     **split})
    return rows


def time_split(measured: pd.DataFrame, sim_dirs: list[Path]) -> dict[str, float]:
    """A t=0 run's time split into its windows' GPU time and the CPU time between them (each
    window's start to the next one's less its GPU time), simulated (the mean over ``sim_dirs``,
    which form the same windows) against measured, and the CPU time's share of the run."""
    def gpu_cpu(s: pd.DataFrame) -> tuple[float, float]:
        return float(s["gpu_s"].sum()), float(window_gaps(s).clip(lower=0.0).sum())

    def rel(sim: float, meas: float) -> float:
        return sim / meas - 1.0 if meas > 0 else math.nan

    g, c = gpu_cpu(measured)
    frames = [read_steps(d / "steps.csv") for d in sim_dirs]
    for d, f in zip(sim_dirs, frames, strict=True):
        if len(f) != len(measured):
            raise InputError(f"{d}: the simulator formed {len(f)} windows where the measured "
                             f"run has {len(measured)}; the time split needs the same windows")
    sims = [gpu_cpu(f) for f in frames]
    sg, sc = (float(np.mean(v)) for v in zip(*sims, strict=True))
    return {"gpu_time_error": rel(sg, g), "cpu_time_error": rel(sc, c),
            "cpu_share": c / (g + c) if g + c > 0 else math.nan}


def leave_one_out(spec: list[ModelRuns], models: list[str] | None, scales: list[float],
                  work: Path, old: bool = True, per_run_host_factor: bool = False,
                  targets: list[ModelRuns] | None = None,
                  ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Each target's runs (default: the spec's, or those of ``models``) predicted by profiles
    fitted on the spec's runs of the other models. ``per_run_host_factor``: the diagnostic that
    reads each predicted run's own host factor (module docstring)."""
    hw = load_profile("hardware", "h200_ops")
    base_ov = load_profile("overhead", "schedlab_h200")
    measured = {r.model: measured_configs(r) for r in spec}
    training = pd.concat([served_windows(r) for r in spec], ignore_index=True)
    if targets is None:
        targets = [r for r in spec if not models or r.model in models]
    extra = [served_windows(r) for r in targets if r not in spec]
    windows = pd.concat([training, *extra], ignore_index=True)
    in_spec = pd.Series(np.arange(len(windows)) < len(training), index=windows.index)

    def host(held_out: str) -> pd.DataFrame:
        """The windows, with host factors against the fold's training runs (the diagnostic)."""
        return with_host_factors(windows, in_spec & (windows["model"] != held_out)) \
            if per_run_host_factor else windows

    gpu_rows = spec_factor_rows(spec, measured, hw, base_ov, work / "factors")
    old_profiles = {"hardware": load_profile("hardware", "h200_calibrated"),
                    "overhead": base_ov}
    rows = []
    # every model's rows: the coefficients conf/hardware/h200_ops.yaml carries
    fits = [{"held_out": "none", **fold_profiles("", host("")[in_spec], gpu_rows, hw)[2]}]
    for runs in targets:
        fold_windows = host(runs.model)
        hw_fold, ov_fold, fit = fold_profiles(runs.model, fold_windows[in_spec], gpu_rows, hw)
        if not any(f["held_out"] == runs.model for f in fits):
            fits.append({"held_out": runs.model, **fit})
        configs = measured[runs.model] if runs in spec else measured_configs(runs)
        for (policy, k, rate), meas in sorted(configs.items(), key=str):
            f = config_factor(runs, fold_windows, policy, k, rate) \
                if per_run_host_factor else None
            ov = ov_fold if f is None else scaled_overhead(ov_fold, f)
            rows += predict_config(runs, policy, k, rate, meas,
                                   {"hardware": hw_fold, "overhead": ov}, scales, work, NEW,
                                   host_factor=f)
            if old:
                rows += predict_config(runs, policy, k, rate, meas, old_profiles, scales, work,
                                       OLD)
    return pd.DataFrame(rows), pd.DataFrame(fits)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = _Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/validation/models",
                    help="path prefix of the tables: OUT.csv, OUT_fit.csv and OUT.md")
    ap.add_argument("--runs", default="leave_one_out_runs", help="where simulated runs go")
    ap.add_argument("--spec", default=None,
                    help="YAML list of model runs (model, dirs, rate, steps, poisson_steps, "
                    "overrides); default: the five H200 models in docs/validation/measured")
    ap.add_argument("--models", default=None,
                    help="comma-separated models to hold out (default: every model)")
    ap.add_argument("--predict", default=None, metavar="ROOT",
                    help="predict the runs under ROOT/MODEL/{t0,poisson} instead of the spec's, "
                    "each by the fold that holds out its model (e.g. the same configurations "
                    "measured again on another host)")
    ap.add_argument("--sim-repeats", type=int, default=5,
                    help="simulated runs per configuration over time scales 1 +- --sim-spread")
    ap.add_argument("--sim-spread", type=float, default=0.01)
    ap.add_argument("--no-old", action="store_true", help="skip the old profile's predictions")
    ap.add_argument("--per-run-host-factor", action="store_true",
                    help="diagnostic, not a prediction: scale each run's CPU costs, in the fit "
                    "and in its prediction, by its host factor read from that run's own "
                    "update() timings (experiments.host_speed); the tables say so, and no "
                    "headline number uses them")
    ap.add_argument("--no-host-speed", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _without_runs(argv: list[str]) -> list[str]:
    """The command line as the table records it: where the simulated runs went changes nothing."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--runs":
            skip = True
        elif not a.startswith("--runs="):
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args = parse_args(argv)
    try:
        if args.no_host_speed:
            raise InputError("--no-host-speed is gone: no per-run host factor is the default "
                             "(--per-run-host-factor is the diagnostic that reads it)")
        spec = load_spec(args.spec)
        models = args.models.split(",") if args.models else None
        unknown = sorted(set(models or []) - {r.model for r in spec})
        if unknown:
            raise InputError(f"--models: {', '.join(unknown)} not in the spec's models "
                             + ", ".join(r.model for r in spec))
        try:
            scales = time_scales(args.sim_repeats, args.sim_spread)
        except ValueError as err:
            raise InputError(str(err)) from None
        work = writable_dir("--runs", args.runs)
        writable_dir("--out", str(Path(args.out).parent))
        targets = None
        if args.predict:
            targets = [r for r in predicted_runs(args.predict, spec)
                       if not models or r.model in models]
            if not targets:
                raise InputError(f"--predict {args.predict}: no runs of {args.models}")
        df, fits = leave_one_out(spec, models, scales, work, old=not args.no_old,
                                 per_run_host_factor=args.per_run_host_factor, targets=targets)
        command = "python -m experiments.leave_one_out " + " ".join(
            _without_runs(argv if argv is not None else sys.argv[1:]))
        write(df, fits, args.out, command)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(markdown(df, fits, command))
    return df


if __name__ == "__main__":
    main()
