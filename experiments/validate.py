"""Sim-versus-real validation: one grid of workloads on both backends, errors as a table and figure."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pandas as pd
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from experiments.aggregate import parse_rate, row_of
from experiments.calibrate import load_conf
from experiments.files import write_text_atomic
from experiments.run import CONF_DIR, run

METRICS = ["request_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
           "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms",
           "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms"]
# (policy, k): the grid of the validation issue
POLICIES = [("single_step", None), ("multi_step", 1), ("multi_step", 2), ("multi_step", 4),
            ("multi_step", 8), ("multi_step", 16), ("cp1", 8), ("cp2", 8)]


def config_overrides(policy: str, k: int | None, rate: float, args, num_prompts: int,
                     seed: int) -> list[str]:
    ov = [f"policy={policy}", f"model={args.model}", f"workload={args.workload}",
          f"workload.num_prompts={num_prompts}", f"workload.seed={seed}",
          f"workload.request_rate={'inf' if math.isinf(rate) else rate}", "progress=false"]
    if k is not None:
        ov.append(f"policy.num_steps={k}")
    return ov + list(args.override)


def run_one(overrides: list[str], run_dir: Path,
            replace: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Compose the config as the run command would, then run it (unless already done)."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)
    cfg.update(replace or {})  # profiles given as files rather than names in conf/
    result, stamp = run_dir / "result.json", run_dir / "config.json"
    key = json.dumps(cfg, sort_keys=True, default=str)
    if result.exists() and stamp.exists() and stamp.read_text() == key:
        return json.loads(result.read_text())  # resumable: the same run is not repeated
    out = run(cfg, run_dir)
    stamp.write_text(key)  # written last: a run cut short leaves no stamp and is redone
    return out


def measured_from_dir(root: Path) -> dict[tuple, dict[str, Any]]:
    """Measured results keyed by (policy, k, rate) from our or vLLM's result.json files.

    A vLLM benchmark_serving file names its policy through --metadata (policy=..., num_steps=...)
    or, failing that, is read as multi_step with its num_scheduler_steps (single_step if absent).
    Several files of one configuration are repeats of one measurement (the same workload and
    seed): each metric is their mean, and ``repeats`` / ``spread`` (max - min over the mean, per
    metric) say how much the measurement itself moved. Their KV caches may differ by a few
    blocks (free memory varies between processes); ``cache_sizes`` lists them, and main()
    accepts that only where the simulator predicts the same for every one of them.
    """
    runs: dict[tuple, list[dict[str, Any]]] = {}
    for p in sorted(root.rglob("*.json")):
        try:
            res = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if not isinstance(res, dict) or "request_throughput" not in res:
            continue
        row = row_of(res, p)
        if "schedlab" not in res:
            steps = res.get("num_steps", res.get("num_scheduler_steps"))
            row["policy"] = res.get("policy") or ("multi_step" if steps else "single_step")
            row["k"] = int(steps) if steps else None
            row["num_prompts"] = res.get("num_prompts") or res.get("completed")
            row["seed"] = res.get("seed", 0)  # benchmark_serving's default
        if row["request_rate"] is None:
            raise ValueError(f"{p}: no request_rate; cannot match it to a configuration")
        if row["policy"] != "single_step" and row["k"] is None:
            raise ValueError(f"{p}: policy {row['policy']} without a step count "
                             "(num_steps or num_scheduler_steps)")
        k = None if row["policy"] == "single_step" else int(row["k"])
        runs.setdefault((row["policy"], k, float(row["request_rate"])), []).append(row)
    return {key: _repeats(rows) for key, rows in runs.items()}


def _repeats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's measurement from its repeats: the metrics' means, and their spread
    (NaN where fewer than two repeats have the metric)."""
    first = rows[0]
    for r in rows[1:]:
        for field in ("num_prompts", "seed"):
            a, b = _known(first.get(field)), _known(r.get(field))
            if a != b:
                raise ValueError(f"{r['run_dir']} and {first['run_dir']} measure the same "
                                 f"configuration with different {field} ({b!r} and {a!r})")
    sizes = {_known(r.get("num_blocks")) for r in rows}
    out = {**first, "repeats": len(rows), "spread": {},
           "cache_sizes": sorted(int(b) for b in sizes if b is not None)}
    for m in METRICS:
        vals = [r[m] for r in rows if _known(r.get(m)) is not None]
        if vals:
            mean = sum(vals) / len(vals)
            out[m] = mean
            out["spread"][m] = ((max(vals) - min(vals)) / mean if mean else 0.0) \
                if len(vals) > 1 else math.nan
    return out


def _known(value: Any) -> Any:
    """A recorded value as a comparable one: None where not recorded (None or NaN), numbers
    (a vLLM file's metadata may hold "1") as floats."""
    if value is None or value != value:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


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


def time_scales(repeats: int, spread: float) -> list[float]:
    """The simulated repeats' time scales: ``repeats`` evenly over 1 +- ``spread``."""
    if repeats < 1 or not 0.0 <= spread < 0.5:
        raise ValueError(f"--sim-repeats must be >= 1 and --sim-spread in [0, 0.5), got "
                         f"{repeats} and {spread}")
    if repeats == 1:
        return [1.0]
    return [1.0 - spread + 2.0 * spread * i / (repeats - 1) for i in range(repeats)]


def predict(overrides: list[str], run_dir: Path, profiles: dict, cache_sizes: list[int],
            scales: list[float]) -> dict[str, Any]:
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
        runs = []
        for scale in scales:
            name = run_dir.name + (f"_nb{blocks}" if len(cache_sizes) > 1 else "") \
                + (f"_ts{scale:.6g}" if len(scales) > 1 else "")
            sub = run_dir.with_name(name)
            # one run at scale 1 keeps a --override backend.time_scale
            scaled = [f"backend.time_scale={scale}"] if scales != [1.0] else []
            runs.append(row_of(run_one(overrides + cache + scaled, sub, profiles),
                               sub / "result.json"))
        preds.append(_repeats(runs))
    for p in preds[1:]:
        if any(_known(p.get(m)) != _known(preds[0].get(m)) for m in METRICS):
            raise SystemExit(f"error: --measured-dir: repeats of {run_dir.name} ran with KV "
                             f"caches of {cache_sizes} blocks, and the simulator predicts "
                             "different results for them; keep one cache size per configuration")
    return preds[0]


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="llama3_8b")
    ap.add_argument("--hardware", default="h200_calibrated",
                    help="simulator hardware profile: a name in conf/hardware or a YAML file")
    ap.add_argument("--overhead", default="schedlab_h200",
                    help="simulator overhead profile: a name in conf/overhead or a YAML file")
    ap.add_argument("--device", default="cuda", help="real backend device")
    ap.add_argument("--workload", default="sharegpt")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1, help="workload seed (calibration uses none)")
    ap.add_argument("--rates", default="inf,20,40", help="comma-separated request rates")
    ap.add_argument("--policies", default=None,
                    help="comma-separated policy:k items (default: the full grid)")
    ap.add_argument("--stream-per-step", type=lambda v: v.lower() in ("1", "true", "yes"),
                    default=True, help="simulate per-step streaming, as schedlab's engine does "
                    "(true); false for vLLM V0, whose multi-step windows stream in bursts")
    ap.add_argument("--sim-repeats", type=int, default=9,
                    help="simulated runs per configuration, averaged (see --sim-spread); 1: one "
                    "run, at --override backend.time_scale if given")
    ap.add_argument("--sim-spread", type=float, default=0.01,
                    help="the simulated runs' time scales span 1 +- this: each run is one draw "
                    "of the phase between arrivals and windows, which moves with the step time")
    ap.add_argument("--measured-dir", default=None,
                    help="take the measured side from result.json files here (ours or vLLM's)")
    ap.add_argument("--runs", default="validation_runs", help="where run directories go")
    ap.add_argument("--out", default="docs/validation", help="table and figure directory")
    ap.add_argument("--override", action="append", default=[],
                    help="extra Hydra override for both backends (repeatable)")
    ap.add_argument("--real-override", action="append", default=[],
                    help="extra Hydra override for the real backend only (repeatable)")
    args = ap.parse_args(argv)
    try:
        rates = [parse_rate(r) for r in args.rates.split(",")]
        grid = POLICIES if not args.policies else [
            (p.split(":")[0], int(p.split(":")[1]) if ":" in p else None)
            for p in args.policies.split(",")]
        if args.measured_dir and not Path(args.measured_dir).is_dir():
            raise ValueError(f"--measured-dir {args.measured_dir} is not a directory")
        measured = measured_from_dir(Path(args.measured_dir)) if args.measured_dir else None
        scales = time_scales(args.sim_repeats, args.sim_spread)
    except ValueError as err:
        raise SystemExit(f"error: --rates/--policies/--measured-dir/--sim-*: {err}") from None
    runs = Path(args.runs)
    try:
        profiles = {"hardware": load_conf("hardware", args.hardware),
                    "overhead": load_conf("overhead", args.overhead)}
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    rows = []
    for policy, k in grid:
        for rate in rates:
            tag = f"{policy}_k{k or 1}_rate{rate:g}"
            if measured is None:
                base = config_overrides(policy, k, rate, args, args.num_prompts, args.seed)
                meas = _repeats([row_of(run_one(base + ["backend=real",
                                                        f"backend.device={args.device}"]
                                                + args.real_override, runs / "real" / tag),
                                        runs / "real" / tag / "result.json")])
            else:
                meas = measured.get((policy, k, rate))
                if meas is None:
                    print(f"no measured result for {policy} k={k} rate={rate:g}; skipped")
                    continue
                # simulate the workload that was measured
                n = meas.get("num_prompts")
                seed = meas.get("seed")
                base = config_overrides(policy, k, rate, args,
                                        int(n) if n == n and n is not None else args.num_prompts,
                                        int(seed) if seed == seed and seed is not None else 0)
            stream = [f"backend.stream_per_step={str(args.stream_per_step).lower()}"]
            pred = predict(base + ["backend=sim"] + stream, runs / "sim" / tag, profiles,
                           meas["cache_sizes"], scales)
            for r in relative_errors(pred, meas):
                rows.append({"policy": policy, "k": k, "request_rate": rate, **r})
    if not rows:
        raise SystemExit("error: no configuration had both a simulated and a measured result")
    df = pd.DataFrame(rows)
    out = Path(args.out)
    command = "python -m experiments.validate " + " ".join(argv if argv is not None else
                                                           __import__("sys").argv[1:])
    write_table(df, out, command)
    from experiments.plot import plot_validation

    plot_validation(df, out, title=f"Simulator vs measurement: {args.model}, {args.hardware}")
    print(markdown(df, command))
    return df


if __name__ == "__main__":
    main()
