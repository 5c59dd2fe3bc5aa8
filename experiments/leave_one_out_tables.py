"""The leave-one-model-out tables: their markdown and the files one command writes."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from experiments.files import write_text_atomic

TARGET_METRICS = {"request_throughput": 0.03, "median_ttft_ms": 0.10, "median_tpot_ms": 0.10}
NEW, OLD = "h200_ops (held out)", "h200_calibrated + schedlab_h200"


def markdown(df: pd.DataFrame, fits: pd.DataFrame, command: str) -> str:
    profiles = [NEW] + ([OLD] if (df["profile"] == OLD).any() else [])  # --no-old: NEW only
    old = (f", and by the old profile fitted on llama3_8b's steps (**{OLD}**; for llama3_8b "
           "it is not held out)") if OLD in profiles else ""
    lines = [f"Command: `{command}`", "",
             "Each model's runs predicted by profiles fitted without that model's data "
             f"(**{NEW}**){old}. Error = (predicted - measured) / measured; targets: |error| <= "
             "3% request throughput, <= 10% median TTFT and median TPOT; **bold**: over "
             "target.", ""]
    metrics = list(TARGET_METRICS)
    cols = " | new | old" if OLD in profiles else " | error"
    head = "| model | policy | k | rate | " + " | ".join(
        f"{m} measured{cols}" for m in metrics) + " |"
    lines += [head, "|---|---|---|---|" + ("---|" * (1 + len(profiles))) * len(metrics)]
    key = ["model", "policy", "k", "request_rate"]
    order = {m: i for i, m in enumerate(dict.fromkeys(df["model"]))}
    for (model, policy, k, rate), g in sorted(df.groupby(key, sort=False),
                                              key=lambda kv: (order[kv[0][0]], str(kv[0][1:]))):
        cells = []
        for m in metrics:
            sub = g[g["metric"] == m].set_index("profile")
            meas = sub["measured"].iloc[0]
            cells.append(f"{meas:.4g}")
            for prof in profiles:
                if prof in sub.index:
                    e, over = sub.loc[prof, "rel_error"], sub.loc[prof, "over_target"]
                    cells.append(f"**{e:+.1%}**" if over else f"{e:+.1%}")
                else:
                    cells.append("n/a")
        rate_s = "t=0" if math.isinf(rate) else f"{rate:g}/s"
        lines.append(f"| {model} | {policy} | {k} | {rate_s} | " + " | ".join(cells) + " |")
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


NOTES_MARK = "<!-- notes: kept when the table is rebuilt -->"


def write(df: pd.DataFrame, fits: pd.DataFrame, out: str, command: str) -> None:
    """``out``.csv, ``out``_fit.csv and ``out``.md, each written whole; the .md keeps the
    hand-written notes below NOTES_MARK of the file it replaces."""
    md = Path(f"{out}.md")
    notes = ""
    if md.exists() and NOTES_MARK in (old := md.read_text()):
        notes = "\n" + NOTES_MARK + old.split(NOTES_MARK, 1)[1]
    write_text_atomic(Path(f"{out}.csv"), df.to_csv(index=False, float_format="%.6g"))
    write_text_atomic(Path(f"{out}_fit.csv"), fits.to_csv(index=False, float_format="%.6g"))
    write_text_atomic(md, "# Leave-one-model-out validation (H200)\n\n"
                      + markdown(df, fits, command) + notes)
