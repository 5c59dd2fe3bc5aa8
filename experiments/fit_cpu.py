"""Fitting the engine's CPU costs into an overhead profile: the window and step terms from
served windows (or the microbenchmarks), and overlap scheduling's extra cost per window."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

MIN_SERVED_WINDOWS = 8  # fewer served windows: the CPU costs come from the microbenchmarks


def fit_overhead(data: pd.DataFrame, name: str) -> tuple[dict[str, Any], dict[str, float]]:
    """Per invocation, a + b*num_seqs + c*num_tokens + d*kv_tokens, plus m + n*num_seqs*(k - 1) in
    windows of k > 1 steps, plus x + y*num_seqs in windows mixing prefill and decode sequences,
    plus z*num_layers in windows with prefills (rows that record ``num_layers``); per step,
    e + f*num_seqs.

    With served rows (``Profiler.served``): the window term is the CPU gap a served window
    costs (schedule + input preparation + update), the step term its pythonization. Older data
    without them: schedule + update from the Scheduler bench (k=1) plus the microbenchmarks'
    input preparation per window, and pythonization plus update()'s per-step share per step.
    """
    served = data[data["kind"] == "served"]
    from_served = len(served) >= MIN_SERVED_WINDOWS

    def window_features(rows: pd.DataFrame) -> np.ndarray:
        k = rows["k"].to_numpy(dtype=float)
        n = rows["num_seqs"].to_numpy(dtype=float)
        # windows mixing prefill and decode sequences (rows without the column: none)
        pf = rows.get("num_prefill_seqs", pd.Series(0, index=rows.index)).fillna(0).to_numpy()
        mixed = ((pf > 0) & (pf < n)).astype(float)
        # windows with prefills launch per layer (rows without the model's layer count: none)
        layers = rows.get("num_layers", pd.Series(0, index=rows.index)).fillna(0).to_numpy()
        return np.column_stack([np.ones(len(rows)), n, rows["num_tokens"],
                                rows["kv_tokens"], (k > 1).astype(float), n * (k - 1),
                                mixed, mixed * n, layers * (pf > 0)])

    if from_served:
        # the GPU's idle time between served windows (schedule, preparation, the launch the
        # GPU waits for, the drain, update) less the last step's pythonization, which the
        # per-step term prices (earlier steps' overlap the GPU); data without it (and the CPU):
        # the timed CPU parts
        gap = served.get("gap_s", pd.Series(np.nan, index=served.index))
        y = np.where(gap.notna(), gap - served["pythonize_s"], served["cpu_s"])
        X = window_features(served)
        out_rows = served
    else:
        sched = data[data["kind"] == "scheduler"]
        # schedule()+update() per window, as a function of num_seqs (k=1 rows: one token each)
        s1 = sched[sched["k"] == 1]
        sb = np.polyfit(s1["num_seqs"], s1["sched_s"], 1) if len(s1) >= 2 else np.zeros(2)
        steps = data[data["kind"].isin(["prefill", "decode", "mixed"]) & (data["step"] == 0)]
        X = window_features(steps)
        y = steps["prepare_s"].to_numpy() + np.polyval(sb, steps["num_seqs"].to_numpy())
        out_rows = data[data["kind"].isin(["decode"])]
    coef = _nnls(X, y)
    Xo = np.column_stack([np.ones(len(out_rows)), out_rows["num_seqs"]])
    coef_o = _nnls(Xo, out_rows["pythonize_s"].to_numpy())
    coef_py = coef_o.copy()  # the pythonization fit alone, for its error
    if not from_served:
        # update() appends every step's token to every request: the part of the scheduler's
        # cost that grows with k is per step and per sequence, so it joins the per-step cost
        by_k = {k: sched[sched["k"] == k].set_index("num_seqs")["sched_s"] for k in (1, 8)}
        both = by_k[1].index.intersection(by_k[8].index)
        if len(both) >= 2:
            extra = (by_k[8][both] - by_k[1][both]) / 7  # per extra step
            coef_o[1] += max(float(np.polyfit(both.to_numpy(), extra.to_numpy(), 1)[0]), 0.0)
    prof = {"name": name,
            "schedule_base_us": round(float(coef[0]) * 1e6, 3),
            "schedule_per_seq_us": round(float(coef[1]) * 1e6, 4),
            "schedule_per_token_us": round(float(coef[2]) * 1e6, 5),
            "schedule_per_kv_token_us": round(float(coef[3]) * 1e6, 6),
            "schedule_multi_step_us": round(float(coef[4]) * 1e6, 3),
            "schedule_multi_step_per_seq_us": round(float(coef[5]) * 1e6, 4),
            "schedule_mixed_us": round(float(coef[6]) * 1e6, 3),
            "schedule_mixed_per_seq_us": round(float(coef[7]) * 1e6, 4),
            "schedule_prefill_per_layer_us": round(float(coef[8]) * 1e6, 4),
            "output_base_us": round(float(coef_o[0]) * 1e6, 3),
            "output_per_seq_us": round(float(coef_o[1]) * 1e6, 4),
            "api_per_token_us": 0.0,  # schedlab's engine has no API server
            "async_output_processing": True,
            "defer_last_output": False,  # the engine drains a window's outputs as it ends
            "api_server_on_critical_path": True}
    err = {"schedule_and_prepare": _median_abs_rel(X @ coef, y),
           "output_processing": _median_abs_rel(Xo @ coef_py, out_rows["pythonize_s"].to_numpy())}
    return prof, err


# the CPU time to form and launch a window, in a served run's steps.csv
FORM_COLUMNS = ("schedule_s", "prepare_s", "launch_s")
WINDOW_COLUMNS = ("k", "num_seqs", "num_tokens", "kv_tokens")


def overlap_pairs(plain: pd.DataFrame, overlap: pd.DataFrame) -> pd.DataFrame:
    """The same served windows formed without and with overlap scheduling (two runs at t=0 of
    one policy form identical windows): each window's CPU time to form and launch it, both ways.
    """
    cols = list(WINDOW_COLUMNS)
    if len(plain) != len(overlap) or not (plain[cols].to_numpy()
                                          == overlap[cols].to_numpy()).all():
        raise ValueError("the overlap runs formed other windows than the runs without overlap; "
                         "pair two runs of one policy at t=0")
    return pd.DataFrame({**{c: plain[c].to_numpy() for c in cols},
                         "plain_s": plain[list(FORM_COLUMNS)].sum(axis=1).to_numpy(),
                         "overlap_s": overlap[list(FORM_COLUMNS)].sum(axis=1).to_numpy()})


def fit_overlap(pairs: pd.DataFrame) -> float:
    """``schedule_overlap_us``: the median extra CPU time of forming and launching a window with
    overlap (its inputs gather each sequence's newest token on the device, and its launch queues
    behind the window in flight) over the same window without it."""
    if pairs.empty:
        return 0.0
    return round(max(float((pairs["overlap_s"] - pairs["plain_s"]).median()), 0.0) * 1e6, 3)


def _nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    from scipy.optimize import nnls

    return nnls(X, y)[0]


def _median_abs_rel(pred: np.ndarray, meas: np.ndarray) -> float:
    ok = meas > 0
    return float(np.median(np.abs(pred[ok] / meas[ok] - 1))) if ok.any() else math.nan
