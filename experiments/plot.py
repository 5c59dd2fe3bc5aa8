"""Figures from an aggregated table: req/s and latency versus k, latency versus load, and
simulated versus measured."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import (  # noqa: E402
    FixedLocator,
    FuncFormatter,
    MaxNLocator,
    NullFormatter,
    NullLocator,
    ScalarFormatter,
)

from experiments.figure_style import (  # noqa: E402
    MARKERS,
    OVERLAP_STYLES,
    Style,
    figure_legend,
    marker_face,
    overlap_on,
    policy_colours,
    policy_order,
    save,
)
from experiments.labels import (  # noqa: E402
    human,
    metric_label,
    present,
    rate_label,
    with_unit,
)
from experiments.plot_policies import plot_policies  # noqa: E402

DEFAULT_TABLE = "multirun/steps_sweep/aggregate.csv"

# Series of one panel are shifted sideways by this much (in octaves of k) one from the next, so
# that equal values (cp1 and cp2 at k=1 are one policy) stay visible side by side.
DODGE_OCTAVES = 0.05


def _groups(df: pd.DataFrame, keys: list[str]) -> Iterator[tuple[dict, pd.DataFrame]]:
    keys = [k for k in keys if k in df and df[k].notna().any()]
    if not keys:
        yield {}, df
        return
    for vals, sub in df.groupby(keys, dropna=False):
        vals = vals if isinstance(vals, tuple) else (vals,)
        yield dict(zip(keys, vals, strict=False)), sub


# ---- versus k ---------------------------------------------------------------------------------

def _line_label(values: dict) -> str:
    """A series' full name: the policy, "+ overlap" where overlap is on, then the GPU."""
    label = human("policy", values["policy"])
    if overlap_on(values.get("overlap")):
        label += " + overlap"
    if human("hardware", values.get("hardware")):  # neither None, NaN nor ""
        label += f", {human('hardware', values['hardware'])}"
    return label


@dataclass(frozen=True)
class Series:
    """One line of a k figure: a policy, overlap on or off, on one GPU."""

    policy: str
    overlap: bool
    hardware: str  # "" where the table names none


def _series(sub: pd.DataFrame) -> list[tuple[Series, pd.DataFrame]]:
    sub = sub.assign(_overlap=sub["overlap"].map(overlap_on) if "overlap" in sub else False,
                     _hw=sub["hardware"].fillna("").astype(str) if "hardware" in sub else "")
    found = [(Series(str(p), bool(o), h), line)
             for (p, o, h), line in sub.groupby(["policy", "_overlap", "_hw"])]
    return sorted(found, key=lambda s: (policy_order(s[0].policy), s[0].overlap, s[0].hardware))


def _gpu_markers(series: list[Series]) -> dict[str, str]:
    return {g: MARKERS[i % len(MARKERS)] for i, g in enumerate(sorted({s.hardware
                                                                       for s in series}))}


def _k_styles(series: list[Series]) -> dict[Series, Style]:
    """Colour from the policy, marker from the GPU, line style from overlap: no two series of
    a figure look alike."""
    colours = policy_colours({s.policy for s in series})
    markers = _gpu_markers(series)
    return {s: Style(colours[s.policy], markers[s.hardware], OVERLAP_STYLES[s.overlap],
                     marker_face(colours[s.policy], s.overlap))
            for s in series}


def _dodge(n: int) -> list[float]:
    """The factor each of n series' k is drawn at (k on a log axis: a fixed sideways shift)."""
    return [2 ** ((i - (n - 1) / 2) * DODGE_OCTAVES) for i in range(n)]


def repeats_note(counts: Iterable[int], varied: str = "") -> str:
    """What a figure's points and bars are, from the number of runs behind each point."""
    counts = list(counts)
    lo, hi = min(counts), max(counts)
    if hi == 1:
        return "one run per point, so no bars"
    n = f"{hi}" if lo == hi else f"{lo}-{hi}"
    return f"points: mean of {n} runs{varied}; bars: min-max of those runs"


def _varied(sub: pd.DataFrame) -> str:
    """What the repeats of one configuration differ in, where the table says (time_scale,
    seed)."""
    text = ""
    if "time_scale" in sub and sub["time_scale"].nunique() > 1:
        text += f" at time_scale {sub['time_scale'].min():g}-{sub['time_scale'].max():g}"
    if "seed" in sub and sub["seed"].nunique() > 1:
        text += f" over {sub['seed'].nunique()} seeds"
    return text


def _workload_text(ctx: dict) -> str:
    text = human("workload", ctx.get("workload"))
    if present(ctx.get("num_prompts")):
        text += f" {int(ctx['num_prompts'])} prompts"
    text = f"{text}, {rate_label(ctx.get('request_rate'))}".strip(", ")
    if present(ctx.get("max_concurrency")):
        text += f", at most {int(ctx['max_concurrency'])} in flight"
    return text


def _context_title(what: str, ctx: dict, gpus: list[str]) -> str:
    """Two lines: what is drawn; then the model and workload, and how it was run: the backend,
    the GPU (where the figure has one) and the CPU-overhead profile."""
    data = ", ".join(p for p in (human("model", ctx.get("model")), _workload_text(ctx)) if p)
    how = human("backend", ctx.get("backend"))
    if len(gpus) == 1 and gpus[0]:
        how = f"{how} on {human('hardware', gpus[0])}".strip()
    how = ", ".join(p for p in (how, human("overhead", ctx.get("overhead"))) if p)
    return f"{what}\n{data}" + (f"; {how}" if how else "")


def _y_from_zero(row: Iterable[Axes]) -> None:
    """A row of panels' (shared) y axis from 0: an axis cut above it (29-43 req/s) makes a
    gain look steeper than it is."""
    for ax in row:
        ax.set_ylim(bottom=0)


def _k_axis(ax: Axes, ks: list[float]) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(ks))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlim(min(ks) / 2 ** 0.3, max(ks) * 2 ** 0.3)


def _k_figure(ctx: dict, series: list[tuple[Series, pd.DataFrame]],
              metrics: list[str], what: str) -> Figure:
    """``metrics`` against k: with several GPUs a row per metric and a column per GPU (a row
    shares its y axis), with one GPU the metrics side by side."""
    styles = _k_styles([s for s, _ in series])
    gpus = sorted({s.hardware for s, _ in series})
    split = len(gpus) > 1
    panels = gpus if split else [None]
    shape = (len(metrics), len(panels)) if split else (1, len(metrics))
    fig, grid = plt.subplots(*shape, squeeze=False, sharey="row" if split else False,
                             figsize=(0.6 + 4.6 * shape[1], 1.6 + 3.3 * shape[0]),
                             layout="constrained")
    axes = grid if split else grid.T  # axes[metric][panel]
    ks = sorted({float(k) for _, line in series for k in line["k"]})
    counts: list[int] = []
    most = 0  # series in the fullest panel
    for col, gpu in enumerate(panels):
        in_panel = [(s, line) for s, line in series if gpu is None or s.hardware == gpu]
        most = max(most, len(in_panel))
        for row, metric in enumerate(metrics):
            ax = axes[row][col]
            for (s, line), shift in zip(in_panel, _dodge(len(in_panel)), strict=True):
                by_k = line.groupby("k")[metric].agg(["mean", "min", "max", "count"]).sort_index()
                counts += by_k["count"].tolist()
                spread = [by_k["mean"] - by_k["min"], by_k["max"] - by_k["mean"]]
                st = styles[s]
                ax.errorbar(by_k.index * shift, by_k["mean"],
                            yerr=spread if (by_k["max"] > by_k["min"]).any() else None,
                            color=st.colour, marker=st.marker, linestyle=st.linestyle, ms=5,
                            markerfacecolor=st.face,
                            capsize=2, alpha=0.85, label=_line_label(
                                {"policy": s.policy, "overlap": s.overlap, "hardware": s.hardware}))
            _k_axis(ax, ks)
            ax.grid(alpha=0.3)
            name, unit = metric_label(metric)
            if col == 0:
                ax.set_ylabel(with_unit(name, unit))
            if row == len(metrics) - 1 or not split:
                ax.set_xlabel("scheduler steps per window, k")
            if row == 0 and gpu is not None:
                ax.set_title(human("hardware", gpu))
    for row in grid:  # once every panel is drawn: a row shares its y axis if split
        for shared in [row] if split else [[ax] for ax in row]:
            _y_from_zero(shared)
    fig.suptitle(_context_title(what, ctx, gpus))
    shift = round((_dodge(most)[-1] - 1) * 100)
    note = repeats_note(counts, _varied(pd.concat([line for _, line in series])))
    if shift:
        note += (f"\npoints shifted sideways by up to {shift}% of k so that equal values stay "
                 "visible")
    policies = sorted({s.policy for s, _ in series}, key=policy_order)
    colours = policy_colours(policies)
    markers = _gpu_markers([s for s, _ in series])
    # with one GPU its marker is every series', so a policy drawn at one k reads in the legend
    policy_marker = markers[gpus[0]] if len(gpus) == 1 else None
    groups = [[(Line2D([], [], color=colours[p], lw=2, marker=policy_marker), human("policy", p))
               for p in policies]]
    if len(gpus) > 1:
        groups.append([(Line2D([], [], color="0.35", marker=markers[g], ls="none"),
                        human("hardware", g)) for g in gpus])
    if any(s.overlap for s, _ in series):
        groups.append([(Line2D([], [], color="0.35", ls=OVERLAP_STYLES[o], marker=policy_marker
                               or "o", markerfacecolor=marker_face("0.35", o)),
                        "overlap on" if o else "overlap off")
                       for o in sorted({s.overlap for s, _ in series})])
    figure_legend(fig, groups, note)
    return fig


def _stem(ctx: dict) -> str:
    """A file-name stem from a figure's settings: safe characters only (GPU names have spaces)."""
    stem = "_".join(str(v) for v in ctx.values() if v is not None).replace(" vs ", "+")
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", stem)


# The settings that make a k figure's configuration, in the order its file name gives them.
_STEPS_CONTEXT = ["backend", "model", "workload", "request_rate", "overhead", "num_prompts",
                  "seed", "burstiness", "max_concurrency"]


def _with_seeds(ctx: dict, sub: pd.DataFrame) -> dict:
    """``ctx`` with the figure's seed in its place: the one seed, or "seeds0-99" where the
    figure's points are repeats over several."""
    seeds = sub["seed"].dropna().unique() if "seed" in sub else []
    if len(seeds) == 0:
        return ctx
    seed = seeds[0] if len(seeds) == 1 else f"seeds{min(seeds):g}-{max(seeds):g}"
    return {k: seed if k == "seed" else ctx[k] for k in _STEPS_CONTEXT
            if k in ctx or k == "seed"}


def iter_steps_figures(df: pd.DataFrame) -> Iterator[tuple[str, Figure]]:
    """req/s versus k, and median TTFT and TPOT versus k: a figure of each per configuration
    (every setting but k, the seed and the series' own keys), a series per policy, overlap and
    GPU; repeated runs of one configuration (other seeds too) as their mean and range. One
    figure at a time, so the caller can save and close each before the next is drawn."""
    df = df[df["k"].notna()]
    for ctx, sub in _groups(df, [k for k in _STEPS_CONTEXT if k != "seed"]):
        if sub["k"].nunique() < 2:
            continue
        ctx = _with_seeds(ctx, sub)
        series = _series(sub)
        gpus = " vs ".join(sorted({s.hardware for s, _ in series} - {""}))
        stem = _stem({**ctx, "hardware": gpus})
        yield f"reqs_vs_k_{stem}", _k_figure(
            ctx, series, ["request_throughput"], "Request throughput versus steps per window")
        yield f"latency_vs_k_{stem}", _k_figure(
            ctx, series, ["median_ttft_ms", "median_tpot_ms"],
            "Median latency versus steps per window")


def steps_figures(df: pd.DataFrame) -> list[tuple[str, Figure]]:
    """Every figure of iter_steps_figures, all open (for inspecting them)."""
    return list(iter_steps_figures(df))


def plot_steps(df: pd.DataFrame, out: Path) -> list[Path]:
    """The k figures as files, each closed once saved: a table of many configurations never
    holds more than one figure in memory."""
    return [p for stem, fig in iter_steps_figures(df) for p in save(fig, out, stem)]


# ---- versus load ------------------------------------------------------------------------------

def _k_or_0(k: float) -> float:
    """k as a sort key: a policy without k (NaN) first."""
    return 0.0 if k != k else float(k)


def rates_figures(df: pd.DataFrame) -> list[tuple[str, Figure]]:
    """Every figure of iter_rates_figures, all open (for inspecting them)."""
    return list(iter_rates_figures(df))


def iter_rates_figures(df: pd.DataFrame) -> Iterator[tuple[str, Figure]]:
    """Throughput-latency curves: median TTFT and TPOT versus the achieved throughput, a point
    per offered request rate (its repeats, other seeds too, as their mean, bars their range),
    a series per policy, k and overlap; one figure at a time."""
    df = df[df["request_rate"].notna() & ~df["request_rate"].apply(
        lambda r: math.isinf(r) if isinstance(r, float) else False)]
    for ctx, sub in _groups(df, ["backend", "model", "hardware", "workload", "overhead",
                                 "max_concurrency"]):
        if sub["request_rate"].nunique() < 2:
            continue
        sub = sub.assign(_overlap=sub["overlap"].map(overlap_on) if "overlap" in sub else False)
        colours = policy_colours(set(map(str, sub["policy"])))
        ks = sorted(sub["k"].dropna().unique())
        fig, axes = plt.subplots(1, 2, figsize=(11, 5.2), layout="constrained")
        counts: list[int] = []
        entries = []
        lines = sorted(sub.groupby(["policy", "k", "_overlap"], dropna=False),
                       key=lambda g: (policy_order(str(g[0][0])), _k_or_0(g[0][1]), g[0][2]))
        for (pol, k, ov), line in lines:
            marker = MARKERS[ks.index(k) % len(MARKERS)] if k == k else "o"
            label = human("policy", pol) + (f" k={k:g}" if k == k else "")
            label += " + overlap" if ov else ""
            by_rate = line.groupby("request_rate")
            counts += by_rate.size().tolist()
            x = by_rate["request_throughput"].mean()
            colour = colours[str(pol)]
            st = Style(colour, marker, OVERLAP_STYLES[bool(ov)], marker_face(colour, bool(ov)))
            for ax, metric in zip(axes, ("median_ttft_ms", "median_tpot_ms"), strict=True):
                y = by_rate[metric].agg(["mean", "min", "max"])
                ax.errorbar(x, y["mean"], yerr=[y["mean"] - y["min"], y["max"] - y["mean"]],
                            color=st.colour, marker=st.marker, linestyle=st.linestyle,
                            markerfacecolor=st.face, ms=5, capsize=2, alpha=0.85, label=label)
            entries.append((Line2D([], [], color=st.colour, marker=st.marker, ls=st.linestyle,
                                   markerfacecolor=st.face), label))
        for ax, metric in zip(axes, ("median_ttft_ms", "median_tpot_ms"), strict=True):
            name, unit = metric_label(metric)
            ax.set(xlabel="achieved request throughput (req/s)", ylabel=with_unit(name, unit))
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        gpu = [str(ctx["hardware"])] if "hardware" in ctx else []
        fig.suptitle(_context_title("Median latency versus load", {**ctx, "request_rate": None},
                                    gpu).replace("all at t=0", "Poisson arrivals"))
        ncol = min(4, len(entries))
        fig.legend([h for h, _ in entries], [lbl for _, lbl in entries], ncol=ncol,
                   loc="outside lower center", frameon=False, fontsize=9, title_fontsize=8,
                   title=repeats_note(counts, _varied(sub)) + " (a point per offered rate)")
        yield f"latency_vs_rate_{_stem(ctx)}", fig


def plot_rates(df: pd.DataFrame, out: Path) -> list[Path]:
    return [p for stem, fig in iter_rates_figures(df) for p in save(fig, out, stem)]


# ---- simulated versus measured ----------------------------------------------------------------

# Log-axis tick mantissas from sparse to dense: the first that puts 3-4 ticks on a panel.
_TICK_MANTISSAS = ((1.0,), (1.0, 3.0), (1.0, 2.0, 5.0), (1.0, 1.5, 2.0, 3.0, 5.0, 7.0),
                   tuple(float(m) for m in range(1, 10)))


def log_ticks(lo: float, hi: float, most: int = 4) -> list[float]:
    """Ticks for a log axis over [lo, hi] that a narrow panel can label: 3 to ``most`` round
    values (1-2-5 and denser mantissas) where some set of them gives that many, else 2, or, on
    a range too narrow for any (95-130 ms), evenly spaced round values."""
    decades = range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
    found = []
    for mantissas in _TICK_MANTISSAS:
        ticks = sorted(m * 10.0 ** d for d in decades for m in mantissas
                       if lo <= m * 10.0 ** d <= hi)
        if 3 <= len(ticks) <= most:
            return ticks
        found.append(ticks)
    if len(found[0]) > most:  # many decades: every n-th power of ten
        step = math.ceil(len(found[0]) / most)
        return found[0][::step]
    for ticks in found:  # two labels, rather than crowded ones
        if 2 <= len(ticks) <= most:
            return ticks
    return [float(t) for t in MaxNLocator(nbins=4, steps=[1, 2, 2.5, 5, 10]).tick_values(lo, hi)
            if lo <= t <= hi]


def short_number(value: float, _pos: object = None) -> str:
    """A tick label that fits a narrow panel: 20k, not 20000."""
    return f"{value / 1000:g}k" if abs(value) >= 10_000 else f"{value:g}"


def _equal_limits(values: pd.Series, log: bool) -> tuple[float, float]:
    lo, hi = float(values.min()), float(values.max())
    if log:
        return lo / 1.25, hi * 1.25
    pad = (hi - lo) * 0.08 or abs(hi) * 0.1 or 1.0
    return lo - pad, hi + pad


def validation_figure(df: pd.DataFrame, title: str = "") -> Figure:
    """Predicted (simulator) against measured, a panel per metric on equal log axes (so an
    error of one size looks the same in every panel), with y = x and a +-10% band; colour by
    policy, marker by load; where the table has each side's spread between its runs, bars of
    half that range either way."""
    metrics = list(dict.fromkeys(df["metric"]))
    cols = min(4, len(metrics))
    rows = math.ceil(len(metrics) / cols)
    spare = rows * cols - len(metrics)  # empty panels after the last: the legend goes there
    fig = plt.figure(figsize=(3.3 * cols, 3.3 * rows + (0 if spare >= 2 else 1.2)),
                     layout="constrained")
    grid = fig.add_gridspec(rows, cols)
    axes = [fig.add_subplot(grid[i // cols, i % cols]) for i in range(len(metrics))]
    colours = policy_colours(set(map(str, df["policy"])))
    rate_of = df["request_rate"] if "request_rate" in df else pd.Series(math.inf, df.index)
    df = df.assign(_rate=rate_of.fillna(math.inf).astype(float))
    # offline (all at t=0) first, then the Poisson rates in order
    rates = sorted(df["_rate"].unique(), key=lambda r: (not math.isinf(r), r))
    markers = {r: MARKERS[i % len(MARKERS)] for i, r in enumerate(rates)}
    for ax, metric in zip(axes, metrics, strict=True):
        sub = df[df["metric"] == metric]
        for (pol, rate), pts in sub.groupby(["policy", "_rate"]):
            bars = {}
            for side in ("measured", "predicted"):
                if f"{side}_spread" in pts:  # half the range either way, above zero (log axes)
                    half = pts[side] * pts[f"{side}_spread"].fillna(0.0) / 2
                    bars[side] = [half.clip(upper=pts[side] * 0.99), half]
            ax.errorbar(pts["measured"], pts["predicted"], xerr=bars.get("measured"),
                        yerr=bars.get("predicted"), ls="none", marker=markers[rate], ms=4.5,
                        color=colours[str(pol)], alpha=0.8, elinewidth=0.6, capsize=0,
                        label=f"{human('policy', pol)}, {rate_label(rate)}")
        both = pd.concat([sub["measured"], sub["predicted"]])
        log = bool((both > 0).all())
        lo, hi = _equal_limits(both, log)
        ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="0.88",
                        lw=0, zorder=0)
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, zorder=1)
        if log:
            ax.set(xscale="log", yscale="log")
            ticks = log_ticks(lo, hi)
            for axis in (ax.xaxis, ax.yaxis):  # 20, 50, 100, not 2 x 10^1
                axis.set_major_locator(FixedLocator(ticks))
                axis.set_major_formatter(FuncFormatter(short_number))
                axis.set_minor_formatter(NullFormatter())
        ax.set(xlim=(lo, hi), ylim=(lo, hi))
        ax.set_aspect("equal", adjustable="box")
        name, unit = metric_label(metric)
        ax.set(xlabel=with_unit("measured", unit), ylabel=with_unit("simulated", unit),
               title=name)
        ax.grid(alpha=0.3, lw=0.5)
    policies = sorted(colours, key=policy_order)
    groups = [[(Line2D([], [], color=colours[p], marker="o", ls="none"), human("policy", p))
               for p in policies],
              [(Line2D([], [], color="0.35", marker=markers[r], ls="none"), rate_label(r))
               for r in rates],
              [(Line2D([], [], color="k", ls="--", lw=0.8), "simulated = measured"),
               (Patch(color="0.88"), "within 10%")]]
    if "measured_spread" in df or "predicted_spread" in df:
        repeats = df["repeats"].dropna().astype(int) if "repeats" in df else pd.Series([], int)
        if repeats.empty:
            n = "runs"
        elif repeats.max() > repeats.min():
            n = f"{repeats.min()}-{repeats.max()} runs"
        else:
            n = f"{repeats.min()} run" + ("s" if repeats.min() != 1 else "")
        note = (f"bars: the range between repeated runs (measured: {n}; simulated: runs over "
                "a band of time scales),\ndrawn half either way of their mean")
    else:
        note = "one run per side, so no bars"
    figure_legend(fig, groups, note, fig.add_subplot(grid[rows - 1, cols - spare:]) if spare >= 2
            else None)
    fig.suptitle(title or "Simulator versus measurement")
    return fig


def validation_title(model: str | None, hardware: str | None) -> str:
    where = ", ".join(p for p in (human("model", model), human("hardware", hardware)) if p)
    return "Simulator versus measurement" + (f": {where}" if where else "")


def plot_validation(df: pd.DataFrame, out: Path, title: str = "", *, model: str | None = None,
                    hardware: str | None = None) -> list[Path]:
    """The scatter of validation_figure, titled with the model's and GPU's human names (or
    ``title``), as OUT/validation_scatter.png and .svg."""
    title = title or validation_title(model, hardware)
    return save(validation_figure(df, title), out, "validation_scatter")


# ---- command line -----------------------------------------------------------------------------

# What each drawn column may hold: the figures' metrics are finite and >= 0; k, where a
# policy has one, and the offered rate (inf: all at t=0), where recorded, are > 0.
_METRIC_COLUMNS = ("request_throughput", "median_ttft_ms", "median_tpot_ms", "predicted",
                   "measured")
_SETTING_COLUMNS = ("k", "request_rate")


def check_table(df: pd.DataFrame, table: Path) -> None:
    """Refuse, naming the column and row (1: the first after the header), a value no figure
    can draw truthfully: a word where a number goes, a metric that is NaN, infinite or
    negative, a k or rate <= 0. Drawn anyway, a point would be missing or wrong without a
    word."""
    for col in (c for c in _METRIC_COLUMNS + _SETTING_COLUMNS if c in df):
        raw = df[col]
        values = pd.to_numeric(raw.where(raw.map(lambda v: not isinstance(v, bool))),
                               errors="coerce").astype(float)
        if col in _METRIC_COLUMNS:
            bad = ~(values.between(0, math.inf) & values.map(math.isfinite))
            want = "a finite number >= 0"
        else:
            bad = raw.notna() & ~(values > 0)
            want = "a number > 0 or empty" + (" (inf: all at t=0)" if col == "request_rate"
                                               else "")
        if bad.any():
            pos = int(bad.to_numpy().nonzero()[0][0])
            value = raw.iloc[pos]
            text = repr(value) if isinstance(value, str) else str(value)
            text = text if len(text) <= 40 else text[:37] + "..."
            raise ValueError(f"{table}: column {col}, row {pos + 1}: {text} is not {want}")


def plot_table(table: str | os.PathLike, out: str | os.PathLike | None = None,
               title: str = "") -> list[Path]:
    """Every figure a table gives; ``title``: a validation scatter's (default: a generic one)."""
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
    check_table(df, table)
    out = Path(out) if out else table.parent / "figures"
    if "metric" in df and "predicted" in df:
        return plot_validation(df, out, title)
    made = plot_steps(df, out) + plot_rates(df, out) + plot_policies(df, out)
    if not made:
        raise ValueError(f"{table}: nothing to plot (need >= 2 values of k or of request_rate)")
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("table", nargs="?", default=DEFAULT_TABLE,
                    help=f"aggregate.csv/.parquet or a validation table (default {DEFAULT_TABLE})")
    ap.add_argument("--out", default=None, help="figure directory (default: TABLE's dir/figures)")
    ap.add_argument("--title", default="",
                    help="a validation table's scatter title (default: 'Simulator versus "
                    "measurement'), e.g. validation_title's 'Simulator versus measurement: "
                    "Llama-3-8B, H200 (calibrated)'")
    args = ap.parse_args()
    try:
        made = plot_table(args.table, args.out, args.title)
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
