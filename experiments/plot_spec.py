"""The speculative decoding sweep's figure (+experiment=spec_sweep): mean TPOT and goodput
against request rate, a line per speculation policy and length, a column of panels per
acceptance rate.

    python -m experiments.plot_spec multirun/spec_sweep/aggregate.csv [--out DIR]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from experiments.figure_style import draw_offered, save  # noqa: E402
from experiments.labels import goodput_label, human  # noqa: E402

STEM = "spec_sweep_tpot_goodput"
# the speculation policies in the order drawn, each its colour (no speculation first, grey)
SPEC_COLOURS = {"off": "0.35", "spec_fixed": "tab:blue", "spec_off_under_load": "tab:orange",
                "smartspec": "tab:green"}
_RATE = re.compile(r"rate=([0-9.]+)")


def _acceptance_rate(setting: object) -> float | None:
    """The constant acceptance rate a run's ``acceptance`` column names ("rate=0.6")."""
    m = _RATE.fullmatch(str(setting)) if isinstance(setting, str) else None
    return float(m[1]) if m else None


def spec_table(df: pd.DataFrame) -> pd.DataFrame:
    """The sweep's rows with ``spec_policy`` ("off" without speculation), ``k`` (the speculation
    length; 0 off) and ``acceptance_rate`` (a run without speculation takes its workload's,
    from its directory name's ``workload.acceptance.rate=``)."""
    df = df[np.isfinite(df["request_rate"].astype(float))].copy()
    spec = df["spec_policy"] if "spec_policy" in df else pd.Series(np.nan, index=df.index)
    df["spec_policy"] = spec.astype(object).where(spec.notna(), "off")
    k = df["spec_num_tokens"] if "spec_num_tokens" in df else pd.Series(np.nan, index=df.index)
    df["spec_k"] = k.fillna(0).astype(int)
    rate = (df["acceptance"] if "acceptance" in df else pd.Series(None, index=df.index)).map(
        _acceptance_rate)
    named = df["run_dir"].astype(str).str.extract(r"workload\.acceptance\.rate=([0-9.]+)")[0]
    df["acceptance_rate"] = rate.fillna(named.astype(float))
    return df.dropna(subset=["acceptance_rate"])


def spec_figure(df: pd.DataFrame) -> Figure | None:
    """The figure, or None where the table has fewer than two rates or no speculation runs."""
    if "request_rate" not in df or "run_dir" not in df:
        return None
    df = spec_table(df)
    if df.empty or df["request_rate"].nunique() < 2 or (df["spec_policy"] == "off").all():
        return None
    goodput = "request_goodput"
    rates = sorted(df["acceptance_rate"].unique())
    fig, axes = plt.subplots(2, len(rates), figsize=(5.2 * len(rates), 7.6), squeeze=False,
                             sharex=True)
    lengths = sorted(k for k in df["spec_k"].unique() if k)
    styles = dict(zip(lengths, ("-", "--", ":", "-."), strict=False))
    for col, rate in enumerate(rates):
        sub = df[df["acceptance_rate"] == rate]
        for (policy, k), runs in sorted(sub.groupby(["spec_policy", "spec_k"]),
                                        key=lambda g: (list(SPEC_COLOURS).index(g[0][0])
                                                       if g[0][0] in SPEC_COLOURS else 99, g[0][1])):
            label = "no speculation" if policy == "off" else f"{policy}, k = {k}" + (
                " at most" if policy == "smartspec" else "")
            by_rate = runs.groupby("request_rate")
            for row, column in ((0, "mean_tpot_ms"), (1, goodput)):
                series = by_rate[column].mean().sort_index()
                axes[row][col].plot(series.index, series.values, marker="o",
                                    color=SPEC_COLOURS.get(policy, "tab:purple"),
                                    linestyle=styles.get(k, "-"), label=label)
        axes[0][col].set_title(f"acceptance rate {rate:g} per drafted token", fontsize=10)
        axes[0][col].set_ylabel("mean TPOT (ms)")
        draw_offered(axes[1][col], sub)
        axes[1][col].set_ylabel(goodput_label(sub.to_dict("records")))
        axes[1][col].set_ylim(bottom=0)
        axes[1][col].set_xlabel("request rate (req/s, Poisson)")
        for ax in (axes[0][col], axes[1][col]):
            ax.grid(alpha=0.3)
    handles, labels = axes[1][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8,
               bbox_to_anchor=(0.5, -0.06), frameon=False)
    context = ", ".join(human(c, df[c].iloc[0]) for c in ("model", "hardware", "workload")
                        if c in df and df[c].nunique() == 1)
    draft = df["spec_draft_model"].dropna().unique() if "spec_draft_model" in df else []
    if len(draft) == 1:
        context += f", draft {human('model', draft[0])}"
    fig.suptitle("Speculative decoding policies under load" + (f": {context}" if context else ""),
                 fontsize=11)
    fig.tight_layout()
    return fig


def plot_spec(table: str | Path, out: str | Path | None = None) -> list[Path]:
    """Draw the figure of an aggregate table into ``out`` (default: the table's figures/)."""
    table = Path(table)
    if not table.is_file():
        raise ValueError(f"no table at {table}; run the sweep first "
                         "(python -m experiments.run -m +experiment=spec_sweep)")
    df = pd.read_parquet(table) if table.suffix == ".parquet" else pd.read_csv(table)
    fig = spec_figure(df)
    if fig is None:
        raise ValueError(f"{table}: nothing to plot (need speculation runs at >= 2 request "
                         "rates, with their run_dir)")
    return save(fig, Path(out) if out else table.parent / "figures", STEM)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("table", help="the sweep's aggregate.csv or .parquet")
    ap.add_argument("--out", default=None, help="figure directory (default: TABLE's dir/figures)")
    args = ap.parse_args()
    try:
        made = plot_spec(args.table, args.out)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    for p in made:
        print(p)


if __name__ == "__main__":
    main()
