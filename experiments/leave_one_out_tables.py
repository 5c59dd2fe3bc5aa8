"""The leave-one-model-out tables: their markdown and the files one command writes."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from experiments.files import write_table_markdown, write_text_atomic

TARGET_METRICS = {"request_throughput": 0.03, "median_ttft_ms": 0.10, "median_tpot_ms": 0.10}
# the tails beside the medians: p90 with a target, p99 reported without one (None)
TAIL_METRICS = {"p90_ttft_ms": 0.15, "p90_tpot_ms": 0.15, "p99_ttft_ms": None,
                "p99_tpot_ms": None}
NEW, OLD = "h200_ops (held out)", "h200_calibrated + schedlab_h200"
# the host_scaling column: what a prediction's CPU costs were scaled by
NO_SCALING, PER_RUN = "none", "per_run_host_factor (diagnostic)"


def is_diagnostic(df: pd.DataFrame) -> bool:
    """Whether the table's predictions read the predicted runs' own host factors."""
    return "host_scaling" in df and bool((df["host_scaling"] == PER_RUN).any())


def counts(df: pd.DataFrame) -> dict[str, tuple[int, int, int]]:
    """Per metric with a target, over the held-out profile's cells: (within target, cells
    with both sides known, cells where a side could not be computed)."""
    new = df[df["profile"] == NEW]
    out = {}
    for metric, target in {**TARGET_METRICS, **TAIL_METRICS}.items():
        if target is None:
            continue
        sub = new[new["metric"] == metric]
        known = sub["rel_error"].notna()
        out[metric] = (int((known & ~sub["over_target"].astype(bool)).sum()), int(known.sum()),
                       int((~known).sum()))
    return out


def headline(df: pd.DataFrame) -> str:
    """One sentence: how many held-out cells are within target, medians and p90 tails."""
    c = counts(df)
    med = [c[m] for m in TARGET_METRICS]
    within, total = sum(w for w, _, _ in med), sum(n for _, n, _ in med)
    parts = [f"{within} of {total} cells within target (request throughput 3%, median TTFT and "
             "median TPOT 10%)"]
    for metric, label in (("p90_ttft_ms", "p90 TTFT"), ("p90_tpot_ms", "p90 TPOT")):
        w, n, missing = c[metric]
        parts.append(f"{w} of {n} {label} cells within 15%"
                     + (f" ({missing} not computable)" if missing else ""))
    return "; ".join(parts) + "."


def _cell_table(df: pd.DataFrame, metrics: list[str], profiles: list[str],
                order: dict[str, int]) -> list[str]:
    cols = " | new | old" if OLD in profiles else " | error"
    lines = ["| model | policy | k | rate | " + " | ".join(f"{m} measured{cols}" for m in metrics)
             + " |", "|---|---|---|---|" + ("---|" * (1 + len(profiles))) * len(metrics)]
    key = ["model", "policy", "k", "request_rate"]
    for (model, policy, k, rate), g in sorted(df.groupby(key, sort=False),
                                              key=lambda kv: (order[kv[0][0]], str(kv[0][1:]))):
        cells = []
        for m in metrics:
            sub = g[g["metric"] == m].set_index("profile")
            meas = sub["measured"].iloc[0] if len(sub) else math.nan
            cells.append("n/a" if meas != meas else f"{meas:.4g}")
            for prof in profiles:
                e = sub.loc[prof, "rel_error"] if prof in sub.index else math.nan
                if e != e:
                    cells.append("n/a")
                else:
                    cells.append(f"**{e:+.1%}**" if sub.loc[prof, "over_target"]
                                 else f"{e:+.1%}")
        rate_s = "t=0" if math.isinf(rate) else f"{rate:g}/s"
        lines.append(f"| {model} | {policy} | {k} | {rate_s} | " + " | ".join(cells) + " |")
    return lines


def markdown(df: pd.DataFrame, fits: pd.DataFrame, command: str) -> str:
    profiles = [NEW] + ([OLD] if (df["profile"] == OLD).any() else [])  # --no-old: NEW only
    old = (f", and by the old profile fitted on llama3_8b's steps (**{OLD}**; for llama3_8b "
           "it is not held out)") if OLD in profiles else ""
    if is_diagnostic(df):
        cpu = ("**Diagnostic, not a prediction** (`--per-run-host-factor`): each fold's CPU fit "
               "puts every training run on a reference host by that run's host factor, and each "
               "prediction's CPU costs are scaled by the host factor of the run it predicts, "
               "read from that run's own `update()` timings (`host_factor`). It reads the answer; "
               "no headline number comes from this table.")
    else:
        cpu = ("CPU costs: each fold's overhead terms fitted on the other models' served windows "
               "pooled as measured. A prediction uses the configuration and the profiles fitted "
               "on other models' runs, nothing of the run it predicts (no per-run host factor).")
    lines = [f"Command: `{command}`", "",
             "Each model's runs predicted by profiles fitted without that model's data "
             f"(**{NEW}**){old}. " + cpu, "",
             "Error = (predicted - measured) / measured; targets: |error| <= 3% request "
             "throughput, <= 10% median TTFT and median TPOT, <= 15% p90 TTFT and p90 TPOT "
             "(p99: reported, no target); **bold**: over target.", "",
             f"{NEW}: " + headline(df), "", "Medians:", ""]
    order = {m: i for i, m in enumerate(dict.fromkeys(df["model"]))}
    lines += _cell_table(df, list(TARGET_METRICS), profiles, order)
    tails = [m for m in TAIL_METRICS if (df["metric"] == m).any()]
    if tails:
        lines += ["", "Tails (the same runs; a measured tail is the mean over the run's repeats, "
                  "each from its per-request lists where its result file has no p90):", ""]
        lines += _cell_table(df, tails, profiles, order)
        missing = df[(df["metric"].isin(tails)) & df["measured"].isna()]
        if not missing.empty:
            where = sorted({(order[r.model], r.model, r.policy, r.k,
                             "t=0" if math.isinf(r.request_rate) else f"{r.request_rate:g}/s")
                            for r in missing.itertuples()})
            lines += ["", "n/a: not computable, the measured result files keep neither the tail "
                      "nor per-request lists to compute it from: "
                      + ", ".join(f"{m} {p} k={k} {rate}" for _, m, p, k, rate in where) + "."]
    metrics = list(TARGET_METRICS) + tails
    lines += ["", "Worst |error| per model and metric" + (" (new / old):" if OLD in profiles
                                                            else ":"), "",
              "| model | " + " | ".join(metrics) + " |", "|---|" + "---|" * len(metrics)]
    for model in order:
        cells = []
        for m in metrics:
            sub = df[(df["model"] == model) & (df["metric"] == m)]
            worst = [sub[sub["profile"] == p]["rel_error"].abs().max() for p in profiles]
            cells.append(" / ".join("n/a" if w != w else f"{w:.1%}" for w in worst))
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    if "gpu_time_error" in df:
        t0 = df[(df["profile"] == NEW) & (df["metric"] == "request_throughput")
                & df["gpu_time_error"].notna()]
        lines += ["", f"At t=0, {NEW} (the simulator forms the measured windows): the windows' "
                  "summed GPU time and the CPU time between them, simulated against measured, "
                  "and the measured CPU time's share of the run:", "",
                  "| model | policy | k | GPU time | CPU time | CPU share |", "|---|---|---|---|---|---|"]
        for r in sorted(t0.itertuples(), key=lambda r: (order[r.model], r.policy)):
            lines.append(f"| {r.model} | {r.policy} | {r.k} | {r.gpu_time_error:+.1%} | "
                         f"{r.cpu_time_error:+.1%} | {r.cpu_share:.0%} |")
    lines += ["", "Coefficients fitted in each fold (the held-out model's rows dropped first):",
              "", "| " + " | ".join(fits.columns) + " |", "|---" * len(fits.columns) + "|"]
    for row in fits.itertuples(index=False):
        lines.append("| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v)
                                       for v in row) + " |")
    return "\n".join(lines) + "\n"


def write(df: pd.DataFrame, fits: pd.DataFrame, out: str, command: str) -> None:
    """``out``.csv, ``out``_fit.csv and ``out``.md, each written whole; the .md keeps the
    hand-written notes of the file it replaces (experiments.files.write_table_markdown)."""
    title = "# Leave-one-model-out validation (H200)" + (
        ", diagnostic: per-run host factor" if is_diagnostic(df) else "")
    write_text_atomic(Path(f"{out}.csv"), df.to_csv(index=False, float_format="%.6g"))
    write_text_atomic(Path(f"{out}_fit.csv"), fits.to_csv(index=False, float_format="%.6g"))
    write_table_markdown(f"{out}.md", title + "\n\n" + markdown(df, fits, command))
