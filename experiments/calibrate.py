"""Calibration's command line: measure on the real backend (or read saved rows), fit, write the profiles.

    python -m experiments.calibrate                       # llama3_8b on cuda -> h200_calibrated
    python -m experiments.calibrate --data calib.csv      # refit saved measurements, no GPU
    python -m experiments.calibrate --ops [--data DIR]    # the operator-table profile: h200_ops
    python -m experiments.calibrate --backend vllm        # vLLM's CPU engine, tiny -> vllm_cpu

``experiments.measure`` runs the profiling grid and served synthetic runs (never the
validation's ShareGPT runs; ``experiments.measure_vllm`` the same on vLLM's engine) and records one row per step and per served window;
``experiments.fit`` sets the coefficients of ``simulator.cost_model`` (least squares of log
step time, the terms the data cannot set held), of ``simulator.clock`` (on the sampled SM
clock, where there is one) and of ``simulator.overhead`` (linear least squares). This module
writes ``conf/hardware/<name>.yaml`` and ``conf/overhead/<overhead_name>.yaml`` (their headers
name the data, the fit errors, the held terms and the numpy/scipy versions) and each fitted
coefficient's bootstrap spread to ``conf/calibration/<name>.uncertainty.csv``. A refit of the
same CSVs gives the same profiles (a test checks the committed ones).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import scipy

from experiments.files import atomic_path
from experiments.fit import (
    _TOL as FIT_TOLERANCE,
)
from experiments.fit import (
    FIT_KEYS,
    STEP_KINDS,
    _shape,
    bootstrap,
    fit_clock,
    fit_gpu,
    fixed_terms,
    term_errors,
)
from experiments.fit_cpu import MIN_SERVED_WINDOWS, fit_overhead, fit_overlap, overlap_pairs
from experiments.measure import (
    OPTIONAL_COLS,
    SHAPE_COLS,
    Profile,
    Profiler,
    _mixed_window,
    _prefill_window,
    decoding_scheduler,
    grid,
    profile,
)
from experiments.profiles import CONF_DIR, InputError, load_conf, write_yaml
from policies import ModelSpec
from simulator.hardware import HardwareSpec

# the names other modules and tests import from here (measuring and fitting live in
# experiments.measure and experiments.fit)
__all__ = ["FIT_KEYS", "MIN_SERVED_WINDOWS", "OPTIONAL_COLS", "SHAPE_COLS", "STEP_KINDS",
           "Profile", "Profiler", "_mixed_window", "_prefill_window", "_shape",
           "decoding_scheduler", "fit_clock", "fit_gpu", "fit_overhead", "grid", "load_conf",
           "main", "profile", "term_errors", "write_yaml"]
DEFAULT_BOOTSTRAP = 200


def _elasticity(value: str) -> float | None:
    """--clock-elasticity: 'fit' (None) or a number >= 0."""
    if value == "fit":
        return None
    try:
        x = float(value)
    except ValueError:
        x = math.nan
    if not (math.isfinite(x) and x >= 0):
        raise argparse.ArgumentTypeError(f"expected 'fit' or a finite number >= 0, got {value!r}")
    return x


def _resamples(value: str) -> int:
    """--bootstrap: 0 (none) or at least 2 resamples (a spread needs two)."""
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0 or n == 1:
        raise argparse.ArgumentTypeError(f"expected 0 or an integer >= 2, got {value!r}")
    return n


# ---------------------------------------------------------------------------- outputs
def _companion(data_csv: Path, part: str) -> Path:
    """Where a calibration CSV's window timeline or clock samples are kept: X.csv (or X.csv.gz)
    -> X.part.csv."""
    name = data_csv.name.removesuffix(".gz")
    return data_csv.with_name(f"{Path(name).stem}.{part}.csv")


def _two_paths(value: str) -> tuple[Path, Path]:
    parts = value.split(",")
    if len(parts) != 2 or not all(Path(p).is_file() for p in parts):
        raise ValueError(f"--overlap-runs must be two steps.csv files, PLAIN,OVERLAP; got {value!r}")
    return Path(parts[0]), Path(parts[1])


# the flags that apply to one kind of calibration only (the rest apply to every kind)
OPS_ONLY = ("spec", "runs", "budget_s")
REAL_ONLY = ("num_blocks", "sustain", "burst", "overlap_runs")
# what each backend's profiles are named by default: (hardware, overhead), and the base
# profile whose datasheet numbers are kept
DEFAULT_NAMES = {"real": ("h200_calibrated", "schedlab_h200"), "vllm": ("vllm_cpu", "vllm_cpu")}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags; one that does not apply to the chosen calibration is one line and exit 2."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("real", "vllm"), default="real",
                    help="whose steps are measured: schedlab's real engine, or vLLM's engine "
                    "(experiments/measure_vllm.py: model=tiny on vLLM's CPU build)")
    ap.add_argument("--model", default=None, help="a name in conf/model (default llama3_8b; "
                    "tiny with --backend vllm)")
    ap.add_argument("--device", default=None, help="cuda (default) or cpu; with --backend vllm "
                    "vLLM's backend.device: cpu (default; vLLM's CPU build) or cuda (CUDA vLLM)")
    ap.add_argument("--num-blocks", type=int, default=None, help="KV blocks (required on cpu)")
    ap.add_argument("--base-hardware", default=None,
                    help="profile whose datasheet numbers are kept (default h200; cpu on cpu "
                    "and with --backend vllm)")
    ap.add_argument("--name", default=None, help="name of the hardware profile written "
                    "(default h200_calibrated; with --ops h200_ops; with --backend vllm "
                    "vllm_cpu)")
    ap.add_argument("--overhead-name", default=None, help="name of the overhead profile "
                    "(default schedlab_h200; with --backend vllm vllm_cpu)")
    ap.add_argument("--conf-dir", default=CONF_DIR, help="where hardware/ and overhead/ go")
    ap.add_argument("--data", default=None, help="refit saved measurements (CSV; with --ops the "
                    "directory of operator tables), no profiling")
    ap.add_argument("--ops", action="store_true",
                    help="the operator-table profile (experiments/calibrate_ops.py): measure the "
                    "tables over every conf/model shape (or read --data), fit its two factors on "
                    "the served t=0 windows of --spec's models")
    ap.add_argument("--spec", default=None, help="--ops: the served runs (experiments."
                    "leave_one_out's --spec; default: the H200 runs in docs/validation/measured)")
    ap.add_argument("--runs", default="leave_one_out_runs",
                    help="--ops: where the fit's simulated runs go")
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="--ops on the GPU: benchmarks/operators.py's time budget")
    ap.add_argument("--save-data", default=None, help="CSV for the measurements, gzipped if it "
                    "ends in .gz (default: conf dir's calibration/<name>.csv; with --backend "
                    "vllm <name>.csv.gz)")
    ap.add_argument("--overlap-runs", default=None, metavar="PLAIN,OVERLAP",
                    help="steps.csv of two served runs of one policy at t=0, without and with "
                    "overlap: their windows' CPU costs are saved beside the data "
                    "(X.overlap.csv) and set schedule_overlap_us")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sustain", type=float, default=None, help="seconds each window runs back "
                    "to back before it is timed (default 0.4 on cuda, 0 on cpu)")
    ap.add_argument("--burst", type=float, default=None, help="seconds of the clock bursts "
                    "(default 10 on cuda, 0: none)")
    ap.add_argument("--quick", action="store_true", help="a tiny grid (CPU smoke test)")
    ap.add_argument("--clock-elasticity", type=_elasticity, default=1.0,
                    help="how much of the sampled clock's slowdown shows in compute-bound "
                    "step times: a number (default 1: step time scales with the clock) or 'fit'. Fitting it was unstable on H200 data (0, "
                    "0.96, 0.06 in three calibrations): the profiled clocks vary too little to "
                    "tell it from matmul efficiency, and a served step's clock is one or two "
                    "samples, noise that pulls a fitted coefficient towards 0")
    ap.add_argument("--fit-tolerance", type=float, default=FIT_TOLERANCE,
                    help="the step-time fit's solver tolerances (ftol, xtol, gtol; default "
                    f"{FIT_TOLERANCE:g}); noisy steps of a loaded CPU converge slowly at the "
                    "default, 1e-6 ends in minutes")
    ap.add_argument("--bootstrap", type=_resamples, default=DEFAULT_BOOTSTRAP,
                    help="refits on rows drawn with replacement, for each fitted coefficient's "
                    f"spread in the conf dir's calibration/<name>.uncertainty.csv (default "
                    f"{DEFAULT_BOOTSTRAP}; 0: none)")
    args = ap.parse_args(argv)
    check_scope(args, vars(ap.parse_args([])))
    hw_name, oh_name = DEFAULT_NAMES[args.backend]
    args.model = args.model or ("tiny" if args.backend == "vllm" else "llama3_8b")
    args.device = args.device or ("cpu" if args.backend == "vllm" else "cuda")
    args.name = args.name or ("h200_ops" if args.ops else hw_name)
    args.overhead_name = args.overhead_name or oh_name
    return args


def check_scope(args: argparse.Namespace, defaults: dict[str, Any]) -> None:
    """A flag given that does not apply to the chosen calibration: one line and exit 2."""
    for dest, value in vars(args).items():
        if value == defaults[dest]:
            continue
        why = None
        if dest in OPS_ONLY and not args.ops:
            why = "applies to --ops only"
        elif args.ops and dest not in OPS_ONLY + ("ops", "data", "name", "conf_dir",
                                                  "base_hardware"):
            why = "does not apply to --ops"
        elif dest in REAL_ONLY and args.backend == "vllm":
            why = "does not apply to --backend vllm (vLLM's engine: conf/backend/vllm.yaml)"
        if why:
            print(f"error: --{dest.replace('_', '-')} {why}", file=sys.stderr)
            raise SystemExit(2)


@dataclasses.dataclass
class Fitted:
    """What the fit of one calibration's rows gives: the hardware profile and its step
    errors, the clock fit's errors, the overhead profile and its errors, the held terms, the
    overlap pairs and the bootstrap spread (None: none asked)."""

    hw: HardwareSpec
    steps: pd.DataFrame
    clock_err: dict[str, float]
    overhead: dict[str, Any]
    overhead_errors: dict[str, float]
    fixed: dict[str, tuple[float, str]]
    pairs: pd.DataFrame
    pairs_csv: Path
    spread: pd.DataFrame | None


def read_data(path: str) -> pd.DataFrame:
    """Saved calibration rows (--data), checked for the columns the fit reads."""
    data = pd.read_csv(path)
    missing = {"kind", "k", "step", "gpu_s", *SHAPE_COLS} - OPTIONAL_COLS - set(data.columns)
    if missing:
        raise ValueError(f"--data {path}: not calibration data (missing "
                         f"{', '.join(sorted(missing))})")
    return data


def measure(args: argparse.Namespace, spec: ModelSpec) -> Profile:
    """Profile the chosen backend on --device: schedlab's engine, or vLLM's engine as
    ``backend=vllm model=<--model>`` runs it (chunked_prefill, 32-token blocks)."""
    if args.backend == "vllm":
        from experiments import measure_vllm
        from experiments.validate import compose_config

        cfg = compose_config(["backend=vllm", f"backend.device={args.device}",
                              f"model={args.model}", "policy=chunked_prefill",
                              "scheduler.block_size=32", "progress=false"])
        return measure_vllm.profile(cfg, args.quick, args.reps)
    backend = {"device": args.device, "num_blocks": args.num_blocks}
    on_gpu = args.device.startswith("cuda")
    sustain = args.sustain if args.sustain is not None else (0.4 if on_gpu else 0.0)
    burst = args.burst if args.burst is not None else (10.0 if on_gpu else 0.0)
    return profile(spec, backend, args.quick, args.reps, sustain_s=sustain, burst_s=burst)


def save_measurements(save: Path, prof: Profile) -> None:
    """The rows (gzipped where the name ends in .gz: a CPU's thousands of served steps), and
    beside them the window timeline and the clock samples."""
    save.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(save) as tmp:
        prof.data.to_csv(tmp, index=False,
                         compression="gzip" if save.suffix == ".gz" else None)
    for part in ("timeline", "clock"):
        with atomic_path(_companion(save, part)) as tmp:
            getattr(prof, part).to_csv(tmp, index=False)


def fit_all(args: argparse.Namespace, spec: ModelSpec, base: HardwareSpec,
            data: pd.DataFrame, save: Path, prof: Profile | None) -> Fitted:
    """The step-time, clock, overhead and overlap fits of the rows, and the bootstrap."""
    # the engine's prefill and piecewise graphs, as profiled (older data: none)
    graphs = {}
    for key in ("prefill_graph_max_tokens", "piecewise_graph_max_tokens"):
        col = data.get(key, pd.Series(dtype=float)).dropna()
        graphs[key] = int(col.max()) if len(col) else 0
    base = dataclasses.replace(base, **graphs)
    fixed = fixed_terms(data, spec, base)
    hw, steps, elasticity = fit_gpu(data, spec, base, args.clock_elasticity, fixed,
                                    args.fit_tolerance)
    if prof is None:  # the window timeline and clock samples saved beside the data, if any
        parts = [_companion(Path(args.data), part) for part in ("timeline", "clock")]
        timeline, clock = (pd.read_csv(f) if f.exists() else pd.DataFrame() for f in parts)
    else:
        timeline, clock = prof.timeline, prof.clock
    hw, clock_err = fit_clock(data, timeline, clock, spec, hw, elasticity)
    overhead, oerr = fit_overhead(data, args.overhead_name)
    if args.backend == "vllm":
        # vLLM's CPU engine is synchronous: each step's outputs are processed before the next
        # is scheduled, and the offline engine has no API server
        overhead.update(async_output_processing=False, api_server_on_critical_path=False)
    pairs_csv = _companion(save, "overlap")
    if args.overlap_runs:
        plain, over = (pd.read_csv(p) for p in _two_paths(args.overlap_runs))
        with atomic_path(pairs_csv) as tmp:
            overlap_pairs(plain, over).to_csv(tmp, index=False)
    pairs = pd.read_csv(pairs_csv) if pairs_csv.exists() else pd.DataFrame()
    overhead["schedule_overlap_us"] = fit_overlap(pairs)
    spread = (bootstrap(data, timeline, clock, spec, base, hw,
                        elasticity if args.clock_elasticity is None else args.clock_elasticity,
                        fixed, args.bootstrap) if args.bootstrap else None)
    return Fitted(hw, steps, clock_err, overhead, oerr, fixed, pairs, pairs_csv, spread)


def clock_text(args: argparse.Namespace, hw: HardwareSpec, clock_err: dict[str, float]) -> str:
    """The profile header's line on the power-limited clock fit."""
    if not clock_err:
        return "Power-limited clock (fitted on the sampled SM clock): not sampled, off"
    return ("Power-limited clock (fitted on the sampled SM clock): "
            f"clock slowdown 1 + {clock_err['clock power slowdown']:.3g} u + "
            f"{clock_err['clock heat slowdown']:.3g} heat (tau {hw.clock_tau_s:.3g} s), rms error "
            f"{clock_err['clock slowdown rms']:.3f} over {clock_err['samples']:.0f} samples;\n"
            f"  step times follow {clock_err['elasticity']:.0%} of it ("
            + ("fitted" if args.clock_elasticity is None
               else f"--clock-elasticity {args.clock_elasticity:g}")
            + "), so the profile's slowdowns are that share")


def write_profiles(args: argparse.Namespace, spec: ModelSpec, base_name: str, fit: Fitted,
                   terms: pd.DataFrame, data: pd.DataFrame, save: Path, command: str,
                   clock_line: str) -> dict[str, Any]:
    """The hardware and overhead profiles, their headers naming the data, the fit errors, the
    held terms and the library versions; and the coefficients' spread. Returns the hardware
    profile as written."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    err_lines = "\n".join(f"  {r.term}: median |err| {r.median_abs_rel_error:.1%}, max "
                          f"{r.max_abs_rel_error:.1%} over {r.points} steps"
                          for r in terms.itertuples())
    hw_d = {f: v for f, v in fit.hw.profile.items()
            if not f.startswith("op_")}  # the operator-table profile's settings: not this fit's
    hw_d["name"] = args.name
    for k, _, _ in FIT_KEYS:
        hw_d[k] = float(f"{hw_d[k]:.6g}")
    uncertainty = Path(args.conf_dir) / "calibration" / f"{args.name}.uncertainty.csv"
    shown = uncertainty.relative_to(args.conf_dir)  # the header is the same wherever it is
    versions = (f"numpy {np.__version__}, scipy {scipy.__version__}, "
                f"pandas {pd.__version__}")
    measured = "" if args.backend == "real" else " on vLLM's engine"
    header = (f"Calibrated by `{command}` on {stamp}, model {spec.name}{measured}\n"
              f"({versions}).\n"
              f"Datasheet numbers from {base_name}; the fitted keys: "
              + ", ".join(k for k, _, _ in FIT_KEYS if k not in fit.fixed) + ".\n"
              "Held out of the fit (the step times cannot set them):\n"
              + "".join(f"  {k} = {v:g}: {why}\n" for k, (v, why) in fit.fixed.items())
              + "Fit error of step time (microbenchmarks and served synthetic runs):\n"
              f"{err_lines}\n{clock_line}\n"
              f"Data: {save}"
              + (f"\nUncertainty: the conf dir's {shown} ({args.bootstrap} bootstrap resamples "
                 "of the rows, seed 0)" if fit.spread is not None else ""))
    write_yaml(Path(args.conf_dir) / "hardware" / f"{args.name}.yaml", hw_d, header)
    served = int((data["kind"] == "served").sum())
    whose = ("schedlab's real backend's CPU costs" if args.backend == "real" else
             "vLLM's engine's CPU costs (synchronous:\nschedule, execute and output "
             "processing in turn; the device's part is execute_model + sample_tokens)")
    served_text = (f"schedule_*: schedule() + update_from_output() per step, fitted on {served}\n"
                   "steps of served synthetic runs; output_*: the engine's output processing per\n"
                   "step (on the critical path).\n")
    oheader = (f"Calibrated by `{command}` on {stamp}: {whose}\n"
               f"({versions}).\n"
               + (served_text if args.backend == "vllm" else f"schedule_*: the GPU's idle time between two served windows (schedule, input\n"
                  f"preparation, launch, drain, update; older data: the timed CPU parts), fitted\n"
                  f"on {served} windows of served synthetic runs;\n"
                  "output_*: pythonization per step (async: overlaps the next step).\n"
                  if served >= MIN_SERVED_WINDOWS else
                  "schedule_*: Scheduler.schedule()+update() plus the runner's input preparation,\n"
                  "per window; output_*: pythonization per step (async: overlaps the next step)\n"
                  "plus update()'s per-step share.\n")
               + f"schedule_overlap_us: the median extra CPU time of a window formed with overlap\n"
               f"over the same window without it, over {len(fit.pairs)} windows "
               f"({fit.pairs_csv.name})\n"
               + "\n".join(f"  {k}: median |err| {v:.1%}" for k, v in fit.overhead_errors.items())
               + (f"\nUncertainty: the conf dir's {shown}" if fit.spread is not None else ""))
    write_yaml(Path(args.conf_dir) / "overhead" / f"{args.overhead_name}.yaml", fit.overhead,
               oheader)
    if fit.spread is not None:
        values = {"hardware": hw_d, "overhead": fit.overhead}
        fit.spread.insert(2, "value", [values[g][k] for g, k in
                                       zip(fit.spread["profile"], fit.spread["coefficient"],
                                           strict=True)])
        uncertainty.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(uncertainty) as tmp:
            fit.spread.to_csv(tmp, index=False, float_format="%.6g")
    return hw_d


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """``python -m experiments.calibrate``: measure (or read --data), fit, write the profiles.
    A bad flag, setting or file is one line on stderr and exit code 2."""
    args = parse_args(argv)
    argv = argv if argv is not None else sys.argv[1:]
    if args.ops:
        from experiments import calibrate_ops

        try:
            return calibrate_ops.run(args, argv)
        except (ValueError, OSError, InputError) as err:
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(2) from None
    try:
        spec = ModelSpec.from_dict(load_conf("model", args.model))
        base_name = args.base_hardware or ("cpu" if args.device == "cpu" else "h200")
        base = HardwareSpec.from_dict(load_conf("hardware", base_name))
        prof = None if args.data else measure(args, spec)
        data = read_data(args.data) if args.data else prof.data
        gz = ".gz" if args.backend == "vllm" else ""
        save = Path(args.save_data or args.data or
                    Path(args.conf_dir) / "calibration" / f"{args.name}.csv{gz}")
        if prof is not None:
            save_measurements(save, prof)
        fit = fit_all(args, spec, base, data, save, prof)
    except (ValueError, OSError, InputError, pd.errors.ParserError) as err:
        print(f"error: {err}", file=sys.stderr)  # one line naming the file or setting
        raise SystemExit(2) from None
    terms = term_errors(fit.steps)
    command = "python -m experiments.calibrate " + " ".join(argv)
    clock_line = clock_text(args, fit.hw, fit.clock_err)
    hw_d = write_profiles(args, spec, base_name, fit, terms, data, save, command, clock_line)
    print(terms.to_string(index=False))
    print(clock_line)
    print("overhead fit: " + ", ".join(f"{k} {v:.1%}" for k, v in fit.overhead_errors.items()))
    print(f"wrote {Path(args.conf_dir) / 'hardware' / (args.name + '.yaml')} and "
          f"{Path(args.conf_dir) / 'overhead' / (args.overhead_name + '.yaml')}")
    return {"hardware": hw_d, "overhead": fit.overhead, "terms": terms,
            "overhead_errors": fit.overhead_errors, "fixed": fit.fixed,
            "uncertainty": fit.spread}


if __name__ == "__main__":
    main()
