"""Cluster figures: a run's load per replica over time (from its steps.csv), the router
sweep's goodput against request rate, a line per router, a panel per replica count, and the
colocated-against-disaggregated sweep's goodput against rate, a line per layout.

    python -m experiments.plot_cluster outputs/<run>/            # load_per_replica.png/.svg
    python -m experiments.plot_cluster multirun/router_sweep/aggregate.csv
    python -m experiments.plot_cluster multirun/pd_sweep/aggregate.csv    # pd_sweep_goodput
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from experiments.figure_style import draw_offered, save  # noqa: E402
from experiments.labels import goodput_label, rate_axis_label  # noqa: E402

ROUTER_ORDER = ("round_robin", "random", "least_outstanding", "least_kv", "power_of_two",
                "prefix_affinity")


def load_figure(run_dir: Path, out: Path | None = None) -> list[Path]:
    """Outstanding requests and KV blocks in use per replica over simulated time (each window's
    close), a line per replica."""
    steps = pd.read_csv(run_dir / "steps.csv")
    if "replica" not in steps:
        raise ValueError(f"{run_dir / 'steps.csv'} has no replica column: not a cluster run "
                         "(cluster.num_replicas > 1)")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for replica, rows in steps.groupby("replica"):
        rows = rows.sort_values("t_start")
        top.plot(rows["t_start"], rows["outstanding"], lw=0.8, label=f"replica {replica}")
        bottom.plot(rows["t_start"], rows["kv_blocks_used"], lw=0.8)
    top.set_ylabel("outstanding requests")
    bottom.set_ylabel("KV blocks in use")
    bottom.set_xlabel("simulated time (s), at each window's close")
    top.set_title("Load per replica")
    if steps["replica"].nunique() <= 16:
        top.legend(fontsize=7, ncol=4)
    return save(fig, out or run_dir, "load_per_replica")


def router_sweep_figure(table: Path, out: Path | None = None) -> list[Path]:
    """The router sweep's figure from its aggregate.csv (router_figure), saved beside it; a
    sweep over layouts with disaggregated ones (``layout``, +experiment=pd_sweep) gets
    layout_figure instead."""
    df = pd.read_csv(table)
    if "layout" in df and df["layout"].notna().any():
        return save(layout_figure(df), out or table.parent, "pd_sweep_goodput")
    missing = {"router", "num_replicas", "request_rate", "request_goodput"} - set(df)
    if missing:
        raise ValueError(f"{table} lacks {sorted(missing)}: not a router sweep's table "
                         "(+experiment=router_sweep)")
    return save(router_figure(df), out or table.parent, "router_sweep_goodput")


def router_figure(df: pd.DataFrame) -> Figure:
    """Goodput against the configured rate (requests, or conversations, a second), a line per
    router, a panel per replica count, with the offered load; the y axis names the targets."""
    counts = sorted(df["num_replicas"].unique())
    fig, axes = plt.subplots(1, len(counts), figsize=(4.2 * len(counts), 3.6), squeeze=False)
    routers = sorted(df["router"].unique(),
                     key=lambda r: (ROUTER_ORDER.index(r) if r in ROUTER_ORDER else 99, r))
    for ax, n in zip(axes[0], counts, strict=True):
        mine = df[df["num_replicas"] == n]
        for i, router in enumerate(routers):
            rows = mine[mine["router"] == router].sort_values("request_rate")
            ax.plot(rows["request_rate"], rows["request_goodput"], marker="o", ms=3,
                    color=f"C{i}", label=router)
        draw_offered(ax, mine)
        ax.set_title(f"{n} replicas")
        ax.set_xlabel(rate_axis_label(df["workload"] if "workload" in df else []))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(goodput_label(df.to_dict("records")).replace(" (", "\n(", 1))
    axes[0][-1].legend(fontsize=7)
    return fig


def layout_figure(df: pd.DataFrame) -> Figure:
    """Goodput against the configured rate, a line per cluster layout ("2 colocated", "1
    prefill + 1 decode"), with the offered load; the y axis names the targets."""
    df = df.copy()
    colocated = df["layout"].isna()
    df.loc[colocated, "layout"] = df.loc[colocated, "num_replicas"].map(
        lambda n: f"{int(n)} colocated")
    fig, ax = plt.subplots(figsize=(5.2, 3.8))
    for i, (layout, rows) in enumerate(sorted(df.groupby("layout"),
                                              key=lambda kv: "colocated" not in kv[0])):
        rows = rows.sort_values("request_rate")
        ax.plot(rows["request_rate"], rows["request_goodput"], marker="o", ms=3, color=f"C{i}",
                label=layout)
    draw_offered(ax, df)
    ax.set_xlabel(rate_axis_label(df["workload"] if "workload" in df else []))
    ax.set_ylabel(goodput_label(df.to_dict("records")).replace(" (", "\n(", 1))
    ax.set_title("Colocated against disaggregated, equal GPUs")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", type=Path, help="a cluster run's directory, or a router or "
                                             "pd sweep's aggregate.csv")
    ap.add_argument("--out", type=Path, default=None, help="where the figures go")
    args = ap.parse_args()
    try:
        paths = (router_sweep_figure(args.path, args.out) if args.path.suffix == ".csv"
                 else load_figure(args.path, args.out))
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    for p in paths:
        print(p)


if __name__ == "__main__":
    main()
