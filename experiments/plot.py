"""Figures from an aggregated table: req/s and latency versus k, latency versus load, sim vs real."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from experiments.files import atomic_path  # noqa: E402

DEFAULT_TABLE = "multirun/steps_sweep/aggregate.csv"


def save(fig, out: Path, stem: str) -> list[Path]:
    """PNG and SVG, each written to a temporary file first so no half figure is left behind."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for ext in ("png", "svg"):
        path = out / f"{stem}.{ext}"
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format=ext, dpi=150, bbox_inches="tight")
        paths.append(path)
    plt.close(fig)
    return paths


def rate_label(rate: float) -> str:
    return "all at t=0" if rate is None or math.isinf(rate) else f"{rate:g} req/s"


def _groups(df: pd.DataFrame, keys: list[str]):
    keys = [k for k in keys if k in df and df[k].notna().any()]
    if not keys:
        yield {}, df
        return
    for vals, sub in df.groupby(keys, dropna=False):
        vals = vals if isinstance(vals, tuple) else (vals,)
        yield dict(zip(keys, vals, strict=False)), sub


def _line_key(sub: pd.DataFrame) -> list[str]:
    keys = ["policy"]
    if "overlap" in sub and sub["overlap"].nunique(dropna=False) > 1:  # overlap on and off
        keys.append("overlap")
    if "hardware" in sub and sub["hardware"].nunique() > 1:
        keys.append("hardware")
    return keys


def _line_label(values: dict) -> str:
    """A series' legend text: the policy, "+ overlap" where overlap is on, then the GPU."""
    label = str(values["policy"])
    if str(values.get("overlap")).lower() in ("true", "1", "1.0"):  # numpy bool, CSV text
        label += " + overlap"
    if "hardware" in values:
        label += f" / {values['hardware']}"
    return label


def _title(ctx: dict, what: str) -> str:
    parts = [str(ctx.get("model", "")), str(ctx.get("hardware", "")) if "hardware" in ctx else "",
             f"{ctx.get('workload', '')} ({rate_label(ctx.get('request_rate'))})"]
    back = ctx.get("backend")
    return f"{what}: " + ", ".join(p for p in parts if p) + (f" [{back}]" if back else "")


def _stem(ctx: dict) -> str:
    """A file-name stem from a figure's settings: safe characters only (GPU names have spaces)."""
    stem = "_".join(str(v) for v in ctx.values() if v is not None).replace(" vs ", "+")
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", stem)


def _plot_repeats(ax, line: pd.DataFrame, col: str, label: str) -> None:
    """``col`` against k; repeats of one k (several runs of one configuration) are drawn as
    their mean with a bar from the smallest to the largest."""
    by_k = line.groupby("k")[col].agg(["mean", "min", "max"]).sort_index()
    spread = [by_k["mean"] - by_k["min"], by_k["max"] - by_k["mean"]]
    ax.errorbar(by_k.index, by_k["mean"], yerr=spread if (by_k["max"] > by_k["min"]).any()
                else None, marker="o", capsize=3, label=label)


def plot_steps(df: pd.DataFrame, out: Path) -> list[Path]:
    """req/s versus k (a line per policy, or per policy and GPU), and TTFT/TPOT versus k;
    repeated runs of one configuration as their mean and range."""
    made: list[Path] = []
    df = df[df["k"].notna()]
    # every setting but k and the line's own keys splits figures, so no line mixes configs
    for ctx, sub in _groups(df, ["backend", "model", "workload", "request_rate", "overhead",
                                 "num_prompts", "seed", "burstiness"]):
        if sub["k"].nunique() < 2:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        fig2, (ax_ttft, ax_tpot) = plt.subplots(1, 2, figsize=(11, 4.2))
        keys = _line_key(sub)
        for name, line in sub.groupby(keys):
            label = _line_label(dict(zip(keys, name if isinstance(name, tuple) else (name,),
                                         strict=True)))
            for a, col in ((ax, "request_throughput"), (ax_ttft, "median_ttft_ms"),
                           (ax_tpot, "median_tpot_ms")):
                _plot_repeats(a, line, col, label)
        hw = " vs ".join(sorted(map(str, sub["hardware"].dropna().unique())))
        ctx = {**ctx, "hardware": hw}
        ax.set(xlabel="scheduler steps per window, k", ylabel="request throughput (req/s)",
               title=_title(ctx, "Throughput vs k"))
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
        ax_ttft.set(xlabel="k", ylabel="median TTFT (ms)", title="TTFT vs k")
        ax_tpot.set(xlabel="k", ylabel="median TPOT (ms)", title="TPOT vs k")
        for a in (ax_ttft, ax_tpot):
            a.grid(alpha=0.3)
            a.legend()
            a.set_ylim(bottom=0)
        fig2.suptitle(_title(ctx, "Latency vs k"))
        stem = _stem(ctx)
        made += save(fig, out, f"reqs_vs_k_{stem}")
        made += save(fig2, out, f"latency_vs_k_{stem}")
    return made


def plot_rates(df: pd.DataFrame, out: Path) -> list[Path]:
    """Throughput-latency curves: median TTFT and TPOT versus the offered request rate (repeats
    at one rate as their mean)."""
    made: list[Path] = []
    df = df[df["request_rate"].notna() & ~df["request_rate"].apply(
        lambda r: math.isinf(r) if isinstance(r, float) else False)]
    for ctx, sub in _groups(df, ["backend", "model", "hardware", "workload"]):
        if sub["request_rate"].nunique() < 2:
            continue
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for (pol, k), line in sub.groupby(["policy", "k"], dropna=False):
            line = line.groupby("request_rate")[["request_throughput", "median_ttft_ms",
                                                  "median_tpot_ms"]].mean()
            line = line.sort_values("request_throughput")
            label = f"{pol} k={k:g}" if k == k else str(pol)
            a1.plot(line["request_throughput"], line["median_ttft_ms"], marker="o", label=label)
            a2.plot(line["request_throughput"], line["median_tpot_ms"], marker="o", label=label)
        a1.set(xlabel="achieved throughput (req/s)", ylabel="median TTFT (ms)")
        a2.set(xlabel="achieved throughput (req/s)", ylabel="median TPOT (ms)")
        for a in (a1, a2):
            a.grid(alpha=0.3)
            a.legend()
        fig.suptitle(_title({**ctx, "request_rate": None}, "Latency vs load").replace(
            " (all at t=0)", " (Poisson arrivals)"))
        stem = _stem(ctx)
        made += save(fig, out, f"latency_vs_rate_{stem}")
    return made


def plot_validation(df: pd.DataFrame, out: Path, title: str = "") -> list[Path]:
    """Predicted (simulator) against measured for each metric, with the y = x line; where the
    table has each side's spread between its runs, bars of half that range either way."""
    metrics = [m for m in df["metric"].unique()]
    cols = min(4, len(metrics))
    rows = math.ceil(len(metrics) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.4 * rows), squeeze=False)
    for ax, metric in zip(axes.flat, metrics, strict=False):
        sub = df[df["metric"] == metric]
        for pol, pts in sub.groupby("policy"):
            bars = {}
            for side in ("measured", "predicted"):
                if f"{side}_spread" in pts:  # half the range either way, above zero (log axes)
                    half = pts[side] * pts[f"{side}_spread"].fillna(0.0) / 2
                    bars[side] = [half.clip(upper=pts[side] * 0.99), half]
            ax.errorbar(pts["measured"], pts["predicted"], xerr=bars.get("measured"),
                        yerr=bars.get("predicted"), fmt="o", ms=4, elinewidth=0.6, capsize=0,
                        label=str(pol))
        lo = min(sub["measured"].min(), sub["predicted"].min())
        hi = max(sub["measured"].max(), sub["predicted"].max())
        ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="y = x")
        if lo > 0 and hi / lo > 30:  # offline TTFTs in seconds beside online ones in ms
            ax.set(xscale="log", yscale="log")
        unit = "req/s" if "throughput" in metric else "ms"
        ax.set(xlabel=f"measured ({unit})", ylabel=f"simulated ({unit})", title=metric)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(metrics):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(title or "Simulator vs measurement")
    fig.tight_layout()
    return save(fig, out, "validation_scatter")


def plot_table(table: str | os.PathLike, out: str | os.PathLike | None = None) -> list[Path]:
    table = Path(table)
    if not table.is_file():
        raise ValueError(f"no table at {table}; run a sweep first "
                         "(python -m experiments.run -m +experiment=steps_sweep)")
    try:
        df = pd.read_parquet(table) if table.suffix == ".parquet" else pd.read_csv(table)
    except Exception as err:  # pandas raises many kinds for a file that is not a table
        raise ValueError(f"{table}: not a readable table ({type(err).__name__})") from None
    need = {"metric", "predicted", "measured"} if "metric" in df else {
        "k", "policy", "request_throughput", "median_ttft_ms", "median_tpot_ms", "request_rate"}
    if need - set(df.columns):
        raise ValueError(f"{table}: missing columns {', '.join(sorted(need - set(df.columns)))}")
    out = Path(out) if out else table.parent / "figures"
    if "metric" in df and "predicted" in df:
        return plot_validation(df, out)
    made = plot_steps(df, out) + plot_rates(df, out)
    if not made:
        raise ValueError(f"{table}: nothing to plot (need >= 2 values of k or of request_rate)")
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("table", nargs="?", default=DEFAULT_TABLE,
                    help=f"aggregate.csv/.parquet or a validation table (default {DEFAULT_TABLE})")
    ap.add_argument("--out", default=None, help="figure directory (default: TABLE's dir/figures)")
    args = ap.parse_args()
    try:
        made = plot_table(args.table, args.out)
    except ValueError as err:  # a table that is not one, or lacks what a figure needs
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except OSError as err:  # --out (or the table's directory) is a file or not writable
        print(f"error: cannot write figures: {err}", file=sys.stderr)
        sys.exit(2)
    for p in made:
        print(p)


if __name__ == "__main__":
    main()
