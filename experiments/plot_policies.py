"""The policy sweep's figures (+experiment=policy_sweep): goodput and p99 TTFT versus request
rate, a line per policy, and the CDF of TTFT per policy at one rate."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from experiments.figure_style import (  # noqa: E402
    draw_offered,
    policy_colours,
    policy_order,
    save,
)
from experiments.labels import goodput_label, human, rate_axis_label  # noqa: E402


def _context(df: pd.DataFrame) -> str:
    parts = [human(col, df[col].iloc[0]) for col in ("model", "hardware", "workload")
             if col in df and df[col].nunique() == 1 and pd.notna(df[col].iloc[0])]
    return ", ".join(parts)


def _rate_label(df: pd.DataFrame) -> str:
    return rate_axis_label(df["workload"] if "workload" in df else [], "Poisson")


def _goodput_column(df: pd.DataFrame) -> tuple[str, str]:
    if "class_goodput" in df and df["class_goodput"].notna().any():
        return "class_goodput", "goodput (req/s meeting their class's TTFT and TPOT targets)"
    return "request_goodput", goodput_label(df.to_dict("records"))


def _by_policy(df: pd.DataFrame, column: str) -> Iterator[tuple[str, pd.Series]]:
    """Each policy's mean of ``column`` per request rate (repeats, e.g. seeds, averaged)."""
    for policy in sorted(df["policy"].unique(), key=policy_order):
        sub = df[df["policy"] == policy]
        yield policy, sub.groupby("request_rate")[column].mean().sort_index()


def policy_figures(df: pd.DataFrame) -> Iterator[tuple[str, Figure]]:
    """(file stem, figure) of each policy figure the table can give: it needs two policies and
    two finite rates; the CDF needs each run's requests.csv (run_dir)."""
    if "policy" not in df or "request_rate" not in df:
        return
    df = df[np.isfinite(df["request_rate"].astype(float))]
    if df["policy"].nunique() < 2 or df["request_rate"].nunique() < 2:
        return
    colours = policy_colours(df["policy"].unique())
    context = _context(df)
    goodput, goodput_label = _goodput_column(df)
    rates = sorted(df["request_rate"].unique())
    for stem, column, label, log in (
            ("goodput_vs_rate", goodput, goodput_label, False),
            ("p99_ttft_vs_rate", "p99_ttft_ms", "p99 TTFT (ms)", True)):
        if column not in df or df[column].isna().all():
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for policy, series in _by_policy(df, column):
            ax.plot(series.index, series.values, marker="o", color=colours[policy],
                    label=human("policy", policy))
        if stem == "goodput_vs_rate":
            draw_offered(ax, df)
            ax.set_ylim(bottom=0)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel(_rate_label(df))
        ax.set_ylabel(label)
        ax.set_title(f"{label.split(' (')[0]} versus load" + (f"\n{context}" if context else ""),
                     fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, ncol=2)
        yield stem, fig
    if "run_dir" in df:
        rate = rates[-2]  # the second highest: overloaded, where ordering matters
        fig = _ttft_cdf(df[df["request_rate"] == rate], colours, rate, context)
        if fig is not None:
            yield f"ttft_cdf_rate{rate:g}", fig
        fig = _overview(df, colours, goodput, goodput_label, rate, context)
        if fig is not None:
            yield "policies_overview", fig


def _overview(df: pd.DataFrame, colours: dict[str, str], goodput: str, goodput_label: str,
              rate: float, context: str) -> Figure | None:
    """The three figures side by side, one legend: the README's figure."""
    if "p99_ttft_ms" not in df:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    for ax, column, label, log in ((axes[0], goodput, goodput_label, False),
                                   (axes[1], "p99_ttft_ms", "p99 TTFT (ms)", True)):
        for policy, series in _by_policy(df, column):
            ax.plot(series.index, series.values, marker="o", color=colours[policy],
                    label=human("policy", policy))
        if not log:
            draw_offered(ax, df)
            ax.set_ylim(bottom=0)
        else:
            ax.set_yscale("log")
        ax.set_xlabel(_rate_label(df))
        ax.set_ylabel(label.replace(" (req/s meeting", "\n(req/s meeting"))
        ax.grid(alpha=0.3)
    if not _draw_cdf(axes[2], df[df["request_rate"] == rate], colours):
        plt.close(fig)
        return None
    axes[2].set_title(f"at {rate:g} req/s", fontsize=10)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9,
               bbox_to_anchor=(0.5, -0.08), frameon=False)
    fig.suptitle("Scheduling policies under load" + (f": {context}" if context else ""),
                 fontsize=11)
    fig.tight_layout()
    return fig


def _draw_cdf(ax, df: pd.DataFrame, colours: dict[str, str]) -> int:
    """Each policy's TTFT CDF from its runs' requests.csv on ``ax``; how many were drawn."""
    drawn = 0
    for policy in sorted(df["policy"].unique(), key=policy_order):
        ttfts = []
        for run_dir in df.loc[df["policy"] == policy, "run_dir"]:
            path = Path(run_dir) / "requests.csv"
            if path.is_file():
                ttfts.append(pd.read_csv(path, usecols=["ttft"])["ttft"].dropna().to_numpy())
        if not ttfts:
            continue
        x = np.sort(np.concatenate(ttfts)) * 1e3
        ax.plot(x, np.arange(1, len(x) + 1) / len(x), color=colours[policy],
                label=human("policy", policy))
        drawn += 1
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)
    return drawn


def _ttft_cdf(df: pd.DataFrame, colours: dict[str, str], rate: float,
              context: str) -> Figure | None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    if _draw_cdf(ax, df, colours) < 2:
        plt.close(fig)
        return None
    ax.set_title(f"CDF of TTFT at {rate:g} req/s" + (f"\n{context}" if context else ""),
                 fontsize=10)
    ax.legend(fontsize=8)
    return fig


def plot_policies(df: pd.DataFrame, out: Path) -> list[Path]:
    """Draw and save each figure, closing it once saved."""
    made: list[Path] = []
    for stem, fig in policy_figures(df):
        made += save(fig, out, stem)
    return made
