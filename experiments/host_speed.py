"""A run's host factor (its speed at the scheduler's Python work), and CPU costs moved by it.

The served runs of docs/validation/measured were measured on the H200 hosts used at the time,
whose CPUs ran the same scheduler code at different speeds. A run's host factor, read from its
windows' update() timings, puts its CPU costs on one reference host for a fit, and a profile's
CPU costs on the run's own host. Read from the run being predicted, it is a diagnostic only
(``experiments.leave_one_out --per-run-host-factor``): a prediction may carry a host's speed
only through a host profile measured before the run (conf/host, benchmarks/scheduler_speed.py).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

# Columns of served windows that hold CPU seconds: divided by the run's host factor before the
# fit, so that the fitted costs are those of the reference host.
CPU_COLUMNS = ("gap_s", "cpu_s", "pythonize_s")


def _window_class(w: pd.DataFrame) -> pd.Series:
    """Windows whose scheduler work follows one path: decode-only of one step, of several
    steps, prefill-only, and mixed."""
    n, pf = w["num_seqs"], w["num_prefill_seqs"].fillna(0)
    return pd.Series(np.select([(pf > 0) & (pf < n), pf >= n, w["k"] > 1],
                               ["mixed", "prefill", "multi"], "decode"), index=w.index)


def with_host_factors(windows: pd.DataFrame, reference: pd.Series | None = None,
                      ) -> pd.DataFrame:
    """Each run's host factor: how slowly its host ran the scheduler's Python work (update() of
    every window, code that does not depend on the model) against the ``reference``
    windows pooled (default: all), as the median ratio over the run's windows, each window
    against the reference's fit (a + b * sequences) of its class of windows. A fold's reference
    is its training runs only, so that a held-out model's runs enter its prediction through
    their own factors and nothing else."""
    from scipy.optimize import nnls

    y = windows["update_s"].to_numpy(float)
    n = windows["num_seqs"].to_numpy(float)
    ref = np.ones(len(windows), bool) if reference is None else reference.to_numpy(bool)
    ratio = np.full(len(windows), np.nan)
    cls = _window_class(windows).to_numpy()
    for c in np.unique(cls):
        m, fit = cls == c, (cls == c) & ref
        if not fit.any():
            continue
        a, b = nnls(np.column_stack([np.ones(fit.sum()), n[fit]]), y[fit])[0]
        pred = a + b * n[m]
        ratio[m] = np.where((pred > 0) & (y[m] > 0), y[m] / np.where(pred > 0, pred, 1.0), np.nan)
    factor = pd.Series(ratio, index=windows.index).groupby(windows["file"]).transform("median")
    return windows.assign(host_factor=factor.fillna(1.0))  # no update() timings: the reference


def on_reference_host(windows: pd.DataFrame) -> pd.DataFrame:
    """The windows' CPU seconds divided by their run's host factor (where there is one)."""
    if "host_factor" not in windows:
        return windows
    return windows.assign(**{c: windows[c] / windows["host_factor"] for c in CPU_COLUMNS})


def scaled_overhead(overhead: dict, factor: float) -> dict:
    """An overhead profile's CPU costs on a host ``factor`` times slower than the reference."""
    return {**overhead, **{key: v * factor for key, v in overhead.items() if key.endswith("_us")}}
