"""Sim-versus-real validation: one grid of workloads on both backends, errors as a table and figure."""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import math
import sys
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any, NoReturn

import pandas as pd
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from experiments.aggregate import row_of
from experiments.files import write_text_atomic
from experiments.measured import (
    METRICS,
    arrivals_csv,
    average_repeats,
    checked_rate,
    known,
    measured_from_dir,
    short_list,
)
from experiments.profiles import InputError, load_profile, one_line
from experiments.run import CONF_DIR, run
from policies.base import POLICIES as POLICY_CLASSES

# (policy, k): the grid of the validation issue, as --policies writes it
POLICIES = "single_step,multi_step:1,multi_step:2,multi_step:4,multi_step:8,multi_step:16,cp1:8,cp2:8"
# How far a measured workload's totals (requests, input and output tokens) may lie from the
# simulated workload's before the comparison is refused: the simulator must run the requests
# that were measured, else its errors measure the workloads' difference.
WORKLOAD_TOLERANCE = 0.01


def replay_overrides(overrides: list[str], trace: str) -> list[str]:
    """``overrides`` with the workload replaced by a trace of the measured requests: their
    send times and lengths (a client's arrivals.csv), not the seed's."""
    kept = [o for o in overrides if not o.startswith("workload")]
    quoted = trace.replace("\\", "\\\\").replace("'", "\\'")  # Hydra's quoted value
    return kept + ["workload=trace", f"workload.trace_path='{quoted}'"]


def config_overrides(policy: str, k: int | None, rate: float, args, num_prompts: int,
                     seed: int) -> list[str]:
    ov = [f"policy={policy}", f"model={args.model}", f"workload={args.workload}",
          f"workload.num_prompts={num_prompts}", f"workload.seed={seed}",
          f"workload.request_rate={'inf' if math.isinf(rate) else rate}", "progress=false"]
    if k is not None:
        ov.append(f"policy.num_steps={k}")
    return ov + list(args.override)


def compose_config(overrides: list[str], sources: dict[str, str] | None = None) -> dict[str, Any]:
    """The config the run command would compose from ``overrides``; a Hydra error is one line
    naming the override it came from (``sources``: override -> the flag that gave it)."""
    try:
        return _compose(overrides)
    except (HydraException, OmegaConfBaseException) as err:
        culprit = overrides[-1]
        for i in range(1, len(overrides)):  # overrides apply in order: the first prefix to fail
            try:
                _compose(overrides[:i])
            except (HydraException, OmegaConfBaseException):
                culprit = overrides[i - 1]
                break
        flag = (sources or {}).get(culprit, "override")
        raise InputError(f"{flag} {culprit}: {one_line(err)}") from None


def _compose(overrides: list[str]) -> dict[str, Any]:
    # a validation composes the same configuration many times; a config file edited since
    # (a profile rewritten by a calibration in the same process) is read again
    key = (tuple(overrides), _conf_stamp())
    if key not in _COMPOSED:
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            cfg = OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)
        if len(_COMPOSED) >= 256:
            _COMPOSED.pop(next(iter(_COMPOSED)))
        _COMPOSED[key] = cfg
    return copy.deepcopy(_COMPOSED[key])


_COMPOSED: dict[tuple, dict[str, Any]] = {}  # (overrides, conf stamp) -> the composed config


def _conf_stamp() -> tuple[int, int]:
    """The config files' count and newest modification time (a walk of ~50 files)."""
    times = [f.stat().st_mtime_ns for f in Path(CONF_DIR).rglob("*.yaml")]
    return len(times), max(times, default=0)


def run_one(overrides: list[str], run_dir: Path,
            replace: dict[str, dict[str, Any]] | None = None,
            sources: dict[str, str] | None = None, quiet: bool = False) -> dict[str, Any]:
    """Compose the config as the run command would, then run it (unless already done);
    ``quiet``: without printing its summary (it is in the run's summary.txt).

    Bad settings, and a run directory that cannot be written, are an InputError naming them.
    """
    cfg = compose_config(overrides, sources)
    cfg.update(replace or {})  # profiles given as files rather than names in conf/
    return run_config(cfg, run_dir, quiet)


def run_config(cfg: dict[str, Any], run_dir: Path, quiet: bool = False) -> dict[str, Any]:
    """``run_one`` of a composed configuration."""
    result, stamp = run_dir / "result.json", run_dir / "config.json"
    key = json.dumps(cfg, sort_keys=True, default=str)
    try:
        if result.exists() and stamp.exists() and stamp.read_text() == key:
            return json.loads(result.read_text())  # resumable: the same run is not repeated
        # a stamp of an earlier configuration goes first: a run cut short after writing its
        # result.json must not leave that result under the earlier configuration's stamp
        stamp.unlink(missing_ok=True)
        with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
            out = run(cfg, run_dir)
        write_text_atomic(stamp, key)  # written last: a run cut short leaves no stamp
    except OSError as err:  # a file it reads or writes (a full disk's error names none)
        raise InputError(f"{run_dir.name}: {err.filename or run_dir}: "
                         f"{err.strerror or err}") from None
    except ValueError as err:
        raise InputError(f"{run_dir.name}: {one_line(err)}") from None
    except TypeError as err:  # a setting of the wrong type (a word where a number goes)
        raise InputError(f"{run_dir.name}: a setting has the wrong type: {one_line(err)}") from None
    return out


def relative_errors(pred: dict, meas: dict) -> list[dict[str, Any]]:
    rows = []
    for m in METRICS:
        p, q = pred.get(m), meas.get(m)
        if p is None or q is None:
            continue
        err = (p - q) / q if q else (0.0 if p == q else math.inf)
        rows.append({"metric": m, "predicted": p, "measured": q, "rel_error": err,
                     "repeats": meas.get("repeats", 1),
                     "measured_spread": meas.get("spread", {}).get(m, math.nan),
                     "predicted_spread": pred.get("spread", {}).get(m, math.nan)})
    return rows


def workload_mismatch(pred: dict[str, Any], meas: dict[str, Any],
                      tolerance: float = WORKLOAD_TOLERANCE) -> tuple[list[str], list[str]]:
    """How each measured repeat's workload differs from the simulated one: its completed
    requests, total input and output tokens, each more than ``tolerance`` (relative) apart;
    and the files that record no totals to compare."""
    problems, unknown = [], []
    for w in meas.get("workloads", []):
        diffs, compared = [], False
        for key, name in (("completed", "requests"), ("total_input_tokens", "input tokens"),
                          ("total_output_tokens", "output tokens")):
            m, p = known(w.get(key)), known(pred.get(key))
            if not isinstance(m, float) or not isinstance(p, float):
                continue
            compared = True
            if abs(p - m) > tolerance * abs(m):
                rel = f"{(p - m) / m:+.1%}" if m else "measured none"
                diffs.append(f"{name} {m:,.0f} measured, {p:,.0f} simulated ({rel})")
        if diffs:
            failed = known(w.get("failed"))
            if isinstance(failed, float) and failed > 0:
                diffs.append(f"{failed:,.0f} measured requests failed")
            problems.append(f"{w.get('file')}: " + ", ".join(diffs))
        elif not compared:
            unknown.append(str(w.get("file")))
    return problems, unknown


def write_table(df: pd.DataFrame, out: Path, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("validation.csv", df.to_csv(index=False)),
                       ("validation.md", markdown(df, command))):
        write_text_atomic(out / name, text)


def markdown(df: pd.DataFrame, command: str) -> str:
    df = df.assign(k=df["k"].fillna(1).astype(int))
    piv = df.pivot_table(index=["policy", "k", "request_rate"], columns="metric",
                         values="rel_error", aggfunc="first")
    keep = [m for m in ("request_throughput", "median_ttft_ms", "median_tpot_ms", "mean_ttft_ms",
                        "mean_tpot_ms", "median_itl_ms", "median_e2el_ms", "p99_ttft_ms")
            if m in piv]
    lines = [f"Command: `{command}`", "",
             "Relative error of the simulator, (simulated - measured) / measured:", "",
             "| policy | k | rate (req/s) | " + " | ".join(keep) + " |",
             "|---|---|---|" + "---|" * len(keep)]
    for (pol, k, rate), row in piv.iterrows():
        lines.append(f"| {pol} | {k} | {rate:g} | " + " | ".join(
            f"{row[m]:+.1%}" if row[m] == row[m] else "n/a" for m in keep) + " |")
    worst = df.groupby("metric")["rel_error"].apply(lambda s: s.abs().max())
    lines += ["", "Worst absolute error over the grid: " + ", ".join(
        f"{m} {worst[m]:.1%}" for m in keep if m in worst)]
    if "repeats" in df and df["repeats"].max() > 1:
        spread = df.groupby("metric")["measured_spread"].max()
        lo, hi = df["repeats"].min(), df["repeats"].max()
        lines += ["", f"Measured side: the mean of {lo if lo == hi else f'{lo}-{hi}'} "
                  "repeats per configuration; the largest spread between repeats (max - min "
                  "over mean): " + ", ".join(f"{m} {spread[m]:.1%}" for m in keep if m in spread)]
    if "predicted_spread" in df and df["predicted_spread"].notna().any():
        spread = df.groupby("metric")["predicted_spread"].max()
        lines += ["", "Simulated side: the mean of runs over a spread of time scales (one run is "
                  "one draw of the phase between arrivals and windows); the largest spread "
                  "between those runs: " + ", ".join(f"{m} {spread[m]:.1%}" for m in keep
                                                     if m in spread)]
    return "\n".join(lines) + "\n"


def measured_limit(meas: dict[str, Any]) -> int | None:
    """The --max-concurrency a measured configuration ran with (vLLM's ``max_concurrency``,
    ours ``schedlab.workload.max_concurrency``), or None where requests were not held back."""
    value = meas.get("max_concurrency")
    if known(value) is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"--measured-dir: {', '.join(meas['files'])}: max_concurrency must be "
                         f"an integer >= 1 or null, got {value!r}")
    return value


def measured_engine(meas: dict[str, Any]) -> list[str]:
    """The overrides that simulate the engine a measurement ran: overlap scheduling, prefix
    caching and the tensor-parallel size, where its result records them (vLLM's files record
    none: overlap and prefix caching were off in its V0 engine, and in runs before schedlab
    cached prefixes)."""
    out = []
    if meas.get("overlap") is True:
        out.append("scheduler.overlap=true")
    if meas.get("enable_prefix_caching") is not True:
        out.append("scheduler.enable_prefix_caching=false")
    tp = known(meas.get("tensor_parallel_size"))
    if tp is not None and tp != 1:
        if not float(tp).is_integer() or tp < 1:
            raise InputError(f"--measured-dir: {', '.join(meas['files'])}: "
                             f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        out.append(f"parallel.tensor_parallel_size={int(tp)}")
    return out


def time_scales(repeats: int, spread: float) -> list[float]:
    """The simulated repeats' time scales: ``repeats`` evenly over 1 +- ``spread``."""
    if repeats < 1 or not 0.0 <= spread < 0.5:
        raise ValueError(f"--sim-repeats must be >= 1 and --sim-spread in [0, 0.5), got "
                         f"{repeats} and {spread}")
    if repeats == 1:
        return [1.0]
    return [1.0 - spread + 2.0 * spread * i / (repeats - 1) for i in range(repeats)]


def sim_run_dirs(run_dir: Path, cache_sizes: list[int], blocks: int | None,
                 scales: list[float]) -> list[Path]:
    """Where predict() puts its simulated runs of one KV cache size, one per time scale."""
    return [run_dir.with_name(run_dir.name + (f"_nb{blocks}" if len(cache_sizes) > 1 else "")
                              + (f"_ts{scale:.6g}" if len(scales) > 1 else ""))
            for scale in scales]


def predict(overrides: list[str], run_dir: Path, profiles: dict, cache_sizes: list[int],
            scales: list[float], sources: dict[str, str] | None = None) -> dict[str, Any]:
    """The simulator's result for a measured configuration: the mean of runs at each of
    ``scales`` (every priced cost times the scale), run with the KV cache that was measured.

    One run is one draw of the phase between arrivals and windows (simulator/engine.py, item
    6); runs over a spread of time scales average it, as measured repeats do. Repeats measured
    with different caches are simulated with each; their predictions must be equal (the cache
    never limited the run), else they are not repeats of one measurement.
    """
    preds = []
    for blocks in cache_sizes or [None]:
        cache = [] if blocks is None else [f"backend.num_blocks={blocks}"]
        cfg = compose_config(overrides + cache, sources)
        cfg.update(profiles or {})
        runs = []
        for scale, sub in zip(scales, sim_run_dirs(run_dir, cache_sizes, blocks, scales)):
            scaled = copy.deepcopy(cfg)
            if scales != [1.0]:  # one run at scale 1 keeps a --override backend.time_scale
                scaled["backend"]["time_scale"] = float(scale)
            runs.append(row_of(run_config(scaled, sub, quiet=True), sub / "result.json"))
        preds.append(average_repeats(runs))
    for p in preds[1:]:
        if any(known(p.get(m)) != known(preds[0].get(m)) for m in METRICS):
            raise InputError(f"--measured-dir: repeats of {run_dir.name} ran with KV caches "
                             f"of {cache_sizes} blocks, and the simulator predicts different "
                             "results for them; keep one cache size per configuration")
    return preds[0]


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (its usage block would bury the error)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see --help)\n")


def _at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value
    return parse


def _spread(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value < 0.5:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 0.5), got {text!r}")
    return value


def _rates(text: str) -> list[float]:
    try:
        return [checked_rate(r.strip()) for r in text.split(",")]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"each rate {err}") from None


def _policy_grid(text: str) -> list[tuple[str, int | None]]:
    """policy:k items; k where (and only where) the policy takes a step count."""
    grid = []
    for item in text.split(","):
        name, colon, k = item.strip().partition(":")
        cls = POLICY_CLASSES.get(name)
        if cls is None:
            raise argparse.ArgumentTypeError(f"unknown policy {name!r}; choose from "
                                             + ", ".join(sorted(POLICY_CLASSES)))
        takes_k = "num_steps" in {f.name for f in fields(cls)}
        if takes_k and not colon:
            raise argparse.ArgumentTypeError(f"{name} needs a step count ({name}:K)")
        if colon and not takes_k:
            raise argparse.ArgumentTypeError(f"{name} takes no step count, got {item!r}")
        try:
            grid.append((name, _at_least(1)(k) if colon else None))
        except argparse.ArgumentTypeError as err:
            raise argparse.ArgumentTypeError(f"{item!r}: the step count {err}") from None
    return grid


def writable_dir(flag: str, path: str) -> Path:
    """``path`` as a directory this process can write in (made if missing)."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise InputError(f"{flag} {out}: a file, not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as err:
        raise InputError(f"{flag} {out}: cannot write there ({err.strerror or err})") from None
    return out


def check_device(device: str, flag: str) -> None:
    """Refuse a CUDA device this host does not have (``flag``: the setting that chose it)."""
    if not str(device).startswith("cuda"):
        return
    try:
        import torch
    except ImportError:
        raise InputError("the real backend needs PyTorch (pip install -e '.[real]'); or "
                         "compare against measured results with --measured-dir") from None
    index = str(device).partition(":")[2]
    if not torch.cuda.is_available():
        raise InputError(f"{flag}: no CUDA GPU here; use --device cpu, or compare against "
                         "measured results with --measured-dir")
    if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
        raise InputError(f"{flag}: this host has {torch.cuda.device_count()} CUDA device(s)")


def _assumed_policy(text: str) -> tuple[str, int | None]:
    """--assume-policy: one policy[:k] item of the grid's form."""
    if "," in text:
        raise argparse.ArgumentTypeError(f"one policy[:k], got {text!r}")
    return _policy_grid(text)[0]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = _Parser(prog="python -m experiments.validate", description=__doc__,
                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="llama3_8b", help="model shape: a name in conf/model")
    ap.add_argument("--hardware", default="h200_calibrated",
                    help="simulator hardware profile: a name in conf/hardware or a YAML file")
    ap.add_argument("--overhead", default="schedlab_h200",
                    help="simulator overhead profile: a name in conf/overhead or a YAML file")
    ap.add_argument("--device", default="cuda",
                    help="the real backend's device (without --measured-dir)")
    ap.add_argument("--workload", default="sharegpt",
                    help="workload: a name in conf/workload (a measured file's client send "
                    "times, where it records them, replace its arrivals)")
    ap.add_argument("--num-prompts", type=_at_least(1), default=1000,
                    help="requests per run (a measured file's own num_prompts wins)")
    ap.add_argument("--seed", type=_at_least(0), default=1,
                    help="workload seed (a measured file's own seed wins; vLLM's default is 0)")
    ap.add_argument("--rates", type=_rates, default="inf,20,40",
                    help="comma-separated request rates (> 0, or inf: all at t=0)")
    ap.add_argument("--policies", type=_policy_grid, default=POLICIES,
                    help="comma-separated policy:k items, k for policies with a step count")
    ap.add_argument("--stream-per-step", type=lambda v: v.lower() in ("1", "true", "yes"),
                    default=True, help="simulate per-step streaming, as schedlab's engine does "
                    "(true); false for vLLM V0, whose multi-step windows stream in bursts")
    ap.add_argument("--sim-repeats", type=_at_least(1), default=9,
                    help="simulated runs per configuration, averaged (see --sim-spread); 1: one "
                    "run, at --override backend.time_scale if given")
    ap.add_argument("--sim-spread", type=_spread, default=0.01,
                    help="the simulated runs' time scales span 1 +- this: each run is one draw "
                    "of the phase between arrivals and windows, which moves with the step time")
    ap.add_argument("--measured-dir", action="append", default=None,
                    help="take the measured side from result.json files here (ours or vLLM's) "
                    "instead of running the real backend; repeatable: several directories "
                    "read as one")
    ap.add_argument("--assume-policy", type=_assumed_policy, default=None, metavar="POLICY[:K]",
                    help="with --measured-dir: the policy of vLLM files that record none "
                    "(saved without --metadata policy=... num_scheduler_steps=...); without "
                    "it such a file is refused")
    ap.add_argument("--allow-workload-mismatch", action="store_true",
                    help="with --measured-dir: compare even where a measured file's requests "
                    "or input or output tokens differ from the simulated workload's by more "
                    f"than {WORKLOAD_TOLERANCE * 100:g}%% (each is named)")
    ap.add_argument("--skip-unreadable", action="store_true",
                    help="with --measured-dir: skip (and name) files that cannot be read, "
                    "rather than stop")
    ap.add_argument("--runs", default="validation_runs",
                    help="where the run directories go (finished runs are reused)")
    ap.add_argument("--out", default="docs/validation",
                    help="where validation.csv, validation.md and the scatter go")
    ap.add_argument("--override", action="append", default=[],
                    help="extra Hydra override for both backends (repeatable)")
    ap.add_argument("--real-override", action="append", default=[],
                    help="extra Hydra override for the real backend only (repeatable)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> pd.DataFrame:
    """The CLI. A bad setting or input file is one line on stderr and exit code 2; Ctrl-C is one
    line and 130 (every file is written whole or not at all, and finished runs are kept)."""
    try:
        return validate(parse_args(argv), argv if argv is not None else sys.argv[1:])
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("interrupted: finished runs are kept and are not repeated by the next run",
              file=sys.stderr)
        raise SystemExit(130) from None


def validate(args: argparse.Namespace, argv: list[str]) -> pd.DataFrame:
    """Run (or read) the measured side and the simulated side of the grid; write the table."""
    measured = _read_measured(args)
    scales = time_scales(args.sim_repeats, args.sim_spread)
    profiles = {group: load_profile(group, getattr(args, group))
                for group in ("hardware", "overhead")}
    sources = {f"model={args.model}": "--model", f"workload={args.workload}": "--workload",
               f"backend.device={args.device}": "--device",
               **{o: "--real-override" for o in args.real_override},
               **{o: "--override" for o in args.override}}
    sim_side = ["backend=sim", f"backend.stream_per_step={str(args.stream_per_step).lower()}"]
    real_side = ["backend=real", f"backend.device={args.device}"] + args.real_override
    # every setting composes, and the real backend has its device, before anything runs
    first = config_overrides(*args.policies[0], args.rates[0], args, args.num_prompts, args.seed)
    compose_config(first + sim_side, sources)
    if measured is None:
        chosen = [o for o in real_side if o.startswith("backend.device=")][-1]
        flag = f"--device {args.device}" if chosen == real_side[1] else f"--real-override {chosen}"
        check_device(compose_config(first + real_side, sources)["backend"]["device"], flag)
    runs, out = writable_dir("--runs", args.runs), writable_dir("--out", args.out)
    rows, used, missing, untotalled = [], set(), [], []
    for policy, k in args.policies:
        for rate in args.rates:
            tag = f"{policy}_k{k or 1}_rate{rate:g}"
            if measured is None:
                base = config_overrides(policy, k, rate, args, args.num_prompts, args.seed)
                real_dir = runs / "real" / tag
                meas = average_repeats([row_of(run_one(base + real_side, real_dir,
                                                       sources=sources, quiet=True),
                                               real_dir / "result.json")])
            else:
                meas = measured.get((policy, k, rate))
                if meas is None:
                    missing.append(f"{policy}{'' if k is None else f' k={k}'} rate={rate:g}")
                    continue
                used.add((policy, k, rate))
                base = _measured_overrides(meas, policy, k, rate, args, runs / "measured" / tag)
            pred = predict(base + sim_side, runs / "sim" / tag, profiles, meas["cache_sizes"],
                           scales, sources)
            if measured is not None:
                untotalled += _check_workload(pred, meas, args)
            for r in relative_errors(pred, meas):
                rows.append({"policy": policy, "k": k, "request_rate": rate, **r})
    _note_unmatched(args, measured, used, missing, untotalled)
    if not rows:
        raise InputError("no configuration had both a simulated and a measured result")
    return _write_outputs(pd.DataFrame(rows), out, args, argv)


def _read_measured(args: argparse.Namespace) -> dict[tuple, dict[str, Any]] | None:
    """--measured-dir's results by (policy, k, rate), or None where the real backend runs."""
    if not args.measured_dir:
        return None
    for d in args.measured_dir:
        if not Path(d).is_dir():
            raise InputError(f"--measured-dir {d}: not a directory")
    try:
        return measured_from_dir([Path(d) for d in args.measured_dir], args.skip_unreadable,
                                 args.assume_policy)
    except ValueError as err:
        raise InputError(f"--measured-dir: {err}") from None


def _measured_overrides(meas: dict[str, Any], policy: str, k: int | None, rate: float,
                        args: argparse.Namespace, tag_path: Path) -> list[str]:
    """The simulated side's overrides for a measured result: the workload that was measured
    (its prompts and seed; its requests as the client sent them, where recorded, written
    beside ``tag_path`` from vLLM's per-request lists), its concurrency limit and engine."""
    n, seed = meas.get("num_prompts"), meas.get("seed")
    base = config_overrides(policy, k, rate, args, args.num_prompts if n is None else n,
                            0 if seed is None else seed)
    if meas.get("arrivals"):  # the requests as the client sent them
        base = replay_overrides(base, meas["arrivals"])
    elif meas.get("sent"):  # the same, from vLLM's client's per-request lists
        trace = tag_path.with_name(f"{tag_path.name}_arrivals.csv")
        trace.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(trace, arrivals_csv(meas["sent"]))
        base = replay_overrides(base, str(trace))
    limit = measured_limit(meas)
    if limit is not None:  # sent as the measurement sent them
        base.append(f"workload.max_concurrency={limit}")
    return base + measured_engine(meas)


def _check_workload(pred: dict[str, Any], meas: dict[str, Any], args: argparse.Namespace
                    ) -> list[str]:
    """Refuse a simulated workload that is not the measured one (unless
    --allow-workload-mismatch, which notes it); the files that record no token totals."""
    problems, unknown = workload_mismatch(pred, meas)
    if problems and not args.allow_workload_mismatch:
        raise InputError(
            f"--measured-dir: {'; '.join(problems)}: the simulated workload "
            f"(--workload {args.workload}, its seed and prompts as measured) is not "
            "the measured one; simulate the requests that were measured, or pass "
            "--allow-workload-mismatch")
    for problem in problems:
        print(f"note: --measured-dir: {problem}; compared anyway "
              "(--allow-workload-mismatch)", file=sys.stderr)
    return unknown


def _note_unmatched(args: argparse.Namespace, measured: dict[tuple, Any] | None,
                    used: set[tuple], missing: list[str], untotalled: list[str]) -> None:
    """One note each on stderr: grid points with no measured result, measured results outside
    the grid, files whose workload could not be compared."""
    if missing:
        print(f"note: no measured result for {len(missing)} of "
              f"{len(args.policies) * len(args.rates)} configurations of --policies and "
              f"--rates; skipped: {short_list(missing, 8)}", file=sys.stderr)
    unused = [f"{', '.join(meas['files'])} ({policy} k={k} rate={rate:g})"
              for (policy, k, rate), meas in sorted((measured or {}).items(), key=str)
              if (policy, k, rate) not in used]
    if unused:
        print(f"note: --measured-dir: {len(unused)} measured configuration(s) not in the grid "
              f"of --policies and --rates, not used: {short_list(unused)}", file=sys.stderr)
    if untotalled:
        print(f"note: --measured-dir: {len(untotalled)} file(s) record no token totals, so "
              f"their workload was not compared: {short_list(untotalled)}", file=sys.stderr)


def _write_outputs(df: pd.DataFrame, out: Path, args: argparse.Namespace, argv: list[str]
                   ) -> pd.DataFrame:
    """validation.csv, validation.md and the scatter in ``out``; the table printed."""
    from experiments.plot import plot_validation

    command = "python -m experiments.validate " + " ".join(argv)
    try:
        write_table(df, out, command)
        plot_validation(df, out, model=args.model, hardware=args.hardware)
    except OSError as err:
        raise InputError(f"--out {out}: cannot write {err.filename or 'the table'}: "
                         f"{err.strerror or err}") from None
    print(markdown(df, command))
    return df


if __name__ == "__main__":
    main()
