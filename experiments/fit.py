"""Fitting calibration rows into simulator profiles: GPU cost-model and clock terms, and the
bootstrap of every fitted coefficient (the CPU costs: ``experiments.fit_cpu``).

Runs on the CPU from the CSVs ``experiments.measure`` writes, and gives the same profile on
every run and, as far as the data allows, under every numpy/scipy version:

- the step-time fit is a least squares of log step time over the logs of the cost model's
  coefficients (each a rate or a time, so a relative step is the same size for all of them),
  solved from a fixed set of start points at tight tolerances, the best kept;
- the terms the step times cannot set are not fitted (``fixed_terms``): ``advance_step_us``
  and ``sampler_us`` (every free fit put them at their bound 0: their time lies inside the
  graph replay and the LM-head terms), ``mixed_kernels_per_layer`` (the data's eager mixed
  steps are all compute-bound, so their launch floor never binds), and ``kernel_launch_us``
  where the data has served launch times (it traded off against ``cuda_graph_replay_us``:
  the launch floor binds only on the smallest piecewise steps, so fits landed far apart
  with the replay moving to match). It is set from a measurement of its own: each served
  piecewise window's CPU launch time over the launches the cost model counts for it;
- ``bootstrap`` resamples the rows and refits, for each coefficient's uncertainty.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pandas as pd

from experiments.fit_cpu import MIN_SERVED_WINDOWS, _nnls, fit_overhead
from experiments.measure import SHAPE_COLS
from policies import ModelSpec
from simulator.cost_model import StepShape, piecewise_eager_kernels, piecewise_tokens, step_time
from simulator.hardware import HardwareSpec

# (key, lower bound, upper bound): the cost-model coefficients the calibration sets, fitted
# or fixed (``fixed_terms``); a fitted one is solved in log space, so its bounds are positive
FIT_KEYS = [("matmul_efficiency", 1e-7, 1.0), ("mem_bw_efficiency", 1e-7, 1.0),
            ("attn_prefill_efficiency", 1e-7, 1.0), ("attn_decode_efficiency", 1e-7, 1.0),
            ("roofline_exponent", 1.0, 64.0), ("attn_seq_gbps", 1.0, 1e5),
            ("kernel_launch_us", 1e-2, 1e4), ("mixed_kernels_per_layer", 0.0, 40.0),
            ("cuda_graph_replay_us", 1e-2, 1e5), ("advance_step_us", 0.0, 1e5),
            ("sampler_us", 0.0, 1e5)]
# the terms the step times cannot set, and why (kernel_launch_us: see fixed_terms)
UNDETERMINED = {
    "advance_step_us": (0.0, "free fits put it at its bound 0 (its time is inside the graph "
                             "replay and the KV terms)"),
    "sampler_us": (0.0, "free fits put it at its bound 0 (its time is inside the LM head's "
                        "terms)"),
    "mixed_kernels_per_layer": (None, "the eager mixed steps are compute-bound, their launch "
                                      "floor never binds: the base profile's value"),
}
# the rows the step-time fit sees: microbenchmark windows and steps of served synthetic runs
STEP_KINDS = ["prefill", "decode", "mixed", "served_step"]
_TOL = 1e-12  # least_squares' ftol, xtol and gtol: converged well past the 6 digits kept
BOOTSTRAP_SEED = 0


def _shape(row: Any) -> StepShape:
    longest = getattr(row, "max_kv_tokens", 0)
    return StepShape(int(row.num_tokens), int(row.num_seqs), int(row.num_prefill_tokens),
                     int(row.num_sampled), float(row.attn_pairs), int(row.kv_tokens),
                     bool(row.is_first), 0 if pd.isna(longest) else int(longest))


def _slowdowns(rows: pd.DataFrame) -> np.ndarray:
    """Each row's measured clock slowdown (max SM clock / its clock); 1 where not sampled."""
    if "sm_mhz" not in rows or "max_sm_mhz" not in rows:
        return np.ones(len(rows))
    slow = (rows["max_sm_mhz"] / rows["sm_mhz"]).to_numpy(dtype=float)
    return np.where(np.isfinite(slow) & (slow > 0), slow, 1.0)


# ---------------------------------------------------------------------------- fixed terms
def served_first_steps(data: pd.DataFrame) -> pd.DataFrame:
    """Each served window's CPU row (``served``) beside its step 1 (``served_step``): joined on
    the window's id where recorded, else in order within each policy (a run records its
    windows in order; the last window has no CPU row). Empty where they do not line up."""
    served = data[data["kind"] == "served"]
    first = data[(data["kind"] == "served_step") & (data["step"] == 0)]
    if served.empty or first.empty or "policy" not in data:
        return pd.DataFrame()
    if "launch_s" not in data:
        return pd.DataFrame()
    keep = ["policy", "launch_s"] + (["served_window"] if "served_window" in data else [])
    if "served_window" in data and served["served_window"].notna().all():
        return first.drop(columns=["launch_s"]).merge(served[keep], on=["policy", "served_window"])
    parts = []
    for policy, rows in served.groupby("policy", sort=True):
        steps = first[first["policy"] == policy].iloc[:len(rows)]
        if len(steps) != len(rows) or not all(
                (steps[c].to_numpy() == rows[c].to_numpy()).all()
                for c in ("num_seqs", "num_tokens", "k")):
            return pd.DataFrame()
        parts.append(steps.assign(launch_s=rows["launch_s"].to_numpy()))
    return pd.concat(parts, ignore_index=True)


def measured_launch_us(data: pd.DataFrame, spec: ModelSpec, hw: HardwareSpec) -> float | None:
    """``kernel_launch_us`` from served piecewise windows: the CPU time to queue step 1 over
    the launches the cost model's floor counts for that window's piecewise step, (L + 1)
    replays and L n_e eager kernels (``simulator.cost_model.piecewise_eager_kernels``: more in
    a mixed step, more where its decode attention splits); the median over the windows. None: no such
    windows (older data, or the CPU, where there are no graphs)."""
    steps = served_first_steps(data)
    if steps.empty:
        return None
    L = spec.num_layers
    per_unit = []
    for r in steps.itertuples():
        shape = _shape(r)
        if piecewise_tokens(shape, hw) is None or pd.isna(r.launch_s):
            continue
        per_unit.append(r.launch_s / (L + 1 + piecewise_eager_kernels(shape, spec, hw) * L))
    if len(per_unit) < MIN_SERVED_WINDOWS:
        return None
    return float(f"{float(np.median(per_unit)) * 1e6:.4g}")


def fixed_terms(data: pd.DataFrame, spec: ModelSpec,
                base: HardwareSpec) -> dict[str, tuple[float, str]]:
    """The coefficients held out of the step-time fit: key -> (value, why)."""
    fixed = {k: (getattr(base, k) if v is None else v, why)
             for k, (v, why) in UNDETERMINED.items()}
    launch = measured_launch_us(data, spec, base)
    if launch is not None:
        n = len(served_first_steps(data))
        fixed["kernel_launch_us"] = (launch, "measured: the median CPU launch time of the "
                                     f"served piecewise windows (of {n} served windows) per "
                                     "launch the cost model counts")
    return fixed


# ---------------------------------------------------------------------------- step times
@dataclasses.dataclass
class _StepFit:
    """The step-time least squares: log predicted over log measured, in the logs of the free
    coefficients (and, when fitted, the clock elasticity, linear and last)."""

    shapes: list[StepShape]
    slows: np.ndarray
    measured: np.ndarray
    spec: ModelSpec
    base: dict[str, Any]
    keys: list[tuple[str, float, float]]
    elasticity: float | None  # None: fitted

    def hw(self, x: np.ndarray) -> HardwareSpec:
        free = {k: float(np.exp(v)) for (k, _, _), v in zip(self.keys, x, strict=False)}
        return HardwareSpec(**{**self.base, **free})

    def elasticity_of(self, x: np.ndarray) -> float:
        return float(x[-1]) if self.elasticity is None else self.elasticity

    def predict(self, x: np.ndarray) -> np.ndarray:
        hw, e = self.hw(x), self.elasticity_of(x)
        return np.array([step_time(s, self.spec, hw, 1.0 + e * (w - 1.0))
                         for s, w in zip(self.shapes, self.slows, strict=True)])

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        lo = [math.log(b[1]) for b in self.keys]
        hi = [math.log(b[2]) for b in self.keys]
        if self.elasticity is None:
            lo, hi = lo + [0.0], hi + [1.5]
        return np.array(lo), np.array(hi)

    def starts(self) -> list[np.ndarray]:
        """Fixed start points: the base profile's values, then two spread over the range (a
        start on the wrong side of a max() term, e.g. an ``attn_seq_gbps`` that never binds,
        sees no gradient there and stays)."""
        spread = [{"efficiency": 0.5, "roofline_exponent": 2.0, "attn_seq_gbps": 100.0, "us": 10.0},
                  {"efficiency": 0.9, "attn_prefill_efficiency": 0.2, "roofline_exponent": 8.0,
                   "attn_seq_gbps": 1000.0, "us": 100.0}]
        points = [[self.base[k] for k, _, _ in self.keys]]
        for s in spread:
            points.append([s.get(k, s["efficiency"] if k.endswith("efficiency")
                                 else s["us"] if k.endswith("_us") else self.base[k])
                           for k, _, _ in self.keys])
        lo, hi = self.bounds()
        out = []
        for p in points:
            z = np.log(np.maximum(np.array(p, dtype=float), 1e-300))
            if self.elasticity is None:
                z = np.append(z, 1.0)
            out.append(np.clip(z, lo + 1e-9, hi - 1e-9))
        return out

    def solve(self, starts: list[np.ndarray], weights: np.ndarray | None = None,
              tol: float = _TOL) -> tuple[np.ndarray, float]:
        """The best of the fits from ``starts`` (lowest cost; the first on a tie)."""
        from scipy.optimize import least_squares

        log_meas = np.log(self.measured)
        w = None if weights is None else np.sqrt(weights)

        def resid(x: np.ndarray) -> np.ndarray:
            r = np.log(np.maximum(self.predict(x), 1e-12)) - log_meas
            return r if w is None else r * w

        best: tuple[np.ndarray, float] | None = None
        for x0 in starts:
            res = least_squares(resid, x0, bounds=self.bounds(), ftol=tol, xtol=tol, gtol=tol,
                                max_nfev=4000)
            if best is None or res.cost < best[1]:
                best = (res.x, float(res.cost))
        assert best is not None
        return best


def _step_problem(data: pd.DataFrame, spec: ModelSpec, base: HardwareSpec,
                  elasticity: float | None,
                  fixed: dict[str, tuple[float, str]] | None) -> tuple[_StepFit, pd.DataFrame]:
    steps = data[data["kind"].isin(STEP_KINDS)].reset_index(drop=True)
    shapes = [_shape(r) for r in steps.itertuples()]
    measured = steps["gpu_s"].to_numpy(dtype=float)
    if len(shapes) < len(FIT_KEYS) or not np.all(measured > 0):
        raise ValueError("calibration data: need positive step times for at least "
                         f"{len(FIT_KEYS)} steps, got {len(shapes)}")
    if fixed is None:
        fixed = fixed_terms(data, spec, base)
    base_d = {f: getattr(base, f) for f in base.__dataclass_fields__}
    base_d.update({k: v for k, (v, _) in fixed.items()})
    keys = [k for k in FIT_KEYS if k[0] not in fixed]
    if not any(s.max_kv_tokens for s in shapes):  # older data: no longest-sequence term
        keys = [k for k in keys if k[0] != "attn_seq_gbps"]
        base_d["attn_seq_gbps"] = 0.0
    elif not base_d["attn_seq_gbps"]:
        base_d["attn_seq_gbps"] = 200.0  # a start for the fit
    if not base_d["roofline_exponent"]:
        base_d["roofline_exponent"] = 4.0  # a start for the fit (0, the plain max, is its limit)
    slows = _slowdowns(steps)
    if not np.any(slows != 1.0):
        elasticity = 0.0  # no clock sampled: nothing to follow
    return _StepFit(shapes, slows, measured, spec, base_d, keys, elasticity), steps


def fit_gpu(data: pd.DataFrame, spec: ModelSpec, base: HardwareSpec,
            elasticity: float | None = 1.0,
            fixed: dict[str, tuple[float, str]] | None = None, tol: float = _TOL,
            ) -> tuple[HardwareSpec, pd.DataFrame, float]:
    """Least squares on log step time over the cost model's free coefficients (bounded; the
    ``fixed`` ones, by default ``fixed_terms``, held). Where the data has each window's sampled
    SM clock, a step is priced at slowdown 1 + elasticity * (max clock / its clock - 1) of its
    compute-bound terms; ``elasticity`` None fits it with the rest (0: the sampled clock
    explains nothing; 1: fully). ``tol``: the solver's tolerances (calibrate's
    --fit-tolerance: a loaded CPU's noisy steps converge slowly at the default). Returns the
    profile, the steps with their predictions, and the elasticity used (0 where no clock was
    sampled)."""
    problem, steps = _step_problem(data, spec, base, elasticity, fixed)
    x, _ = problem.solve(problem.starts(), tol=tol)
    steps = steps.assign(predicted_s=problem.predict(x))
    steps["rel_error"] = steps["predicted_s"] / steps["gpu_s"] - 1
    return problem.hw(x), steps, problem.elasticity_of(x)


# ---------------------------------------------------------------------------- the clock
def _clock_design(data: pd.DataFrame, timeline: pd.DataFrame, clock: pd.DataFrame,
                  spec: ModelSpec, hw: HardwareSpec) -> tuple[Any, ...] | None:
    """What the clock fit needs of the samples: each sample's time, the load history (each
    window run, at its tensor-core share under ``hw``), the running window's share, the
    measured slowdown, and which samples were taken under load. None: too few samples."""
    from simulator.cost_model import step_cost

    if clock.empty or timeline.empty or "max_sm_mhz" not in data:
        return None
    sums: dict[Any, list[float]] = {}  # window id -> [busy, total], summed in row order
    for r in data[data["window"].notna()].itertuples():  # one pass: per-group itertuples cost
        t, b = step_cost(_shape(r), spec, hw)                # seconds on a calibration's rows
        acc = sums.setdefault(r.window, [0.0, 0.0])
        acc[0], acc[1] = acc[0] + b, acc[1] + t
    # window id -> tensor-core share of its GPU time at full clock
    share = {wid: busy / total if total > 0 else 0.0 for wid, (busy, total) in sums.items()}
    tl = timeline.sort_values("end_s")
    starts = (tl["end_s"] - tl["gpu_s"]).to_numpy()
    ends = tl["end_s"].to_numpy()
    us = tl["window"].map(share).fillna(0.0).to_numpy()
    samples = clock.sort_values("t")
    ts = samples["t"].to_numpy()
    slow = float(data["max_sm_mhz"].iloc[0]) / samples["sm_mhz"].to_numpy(dtype=float)
    # the samples taken while a window ran (idle clocks say nothing about loaded ones)
    idx = np.searchsorted(ends, ts)
    on = (idx < len(ends)) & (ts >= starts[np.minimum(idx, len(ends) - 1)])
    on &= slow < 2.0  # not a clock still ramping up from idle
    if on.sum() < 20:
        return None
    return ts, starts, ends, us, us[np.minimum(idx, len(us) - 1)], slow, on


def _clock_rows(design: tuple[Any, ...], spec: ModelSpec, hw: HardwareSpec,
                tau: float) -> tuple[np.ndarray, np.ndarray]:
    """The clock fit's least squares at time constant ``tau``: (u, heat) per loaded sample
    against its slowdown - 1, the load history replayed through ``simulator.clock``."""
    from simulator.clock import PowerClock

    ts, starts, ends, us, running, slow, on = design
    pc = PowerClock(spec, dataclasses.replace(hw, clock_tau_s=float(tau)))
    heat = np.empty(len(ts))
    j = 0
    for s0, e0, u in zip(starts, ends, us, strict=True):
        pc.rest_until(s0)
        while j < len(ts) and ts[j] < e0:  # samples up to this window's end
            if ts[j] >= s0:
                pc.run(u, ts[j] - pc.t)
            else:
                pc.rest_until(ts[j])
            heat[j] = pc.heat
            j += 1
        pc.run(u, e0 - pc.t)
    heat[j:] = pc.heat
    return np.column_stack([running, heat])[on], slow[on] - 1.0


def fit_clock(data: pd.DataFrame, timeline: pd.DataFrame, clock: pd.DataFrame,
              spec: ModelSpec, hw: HardwareSpec,
              elasticity: float = 1.0) -> tuple[HardwareSpec, dict[str, float]]:
    """Fit ``simulator.clock``'s power and heat slowdowns and its time constant on the clock
    samples taken while the GPU ran the profiled windows: the load history (every window run,
    at its tensor-core share under the fitted cost model) is replayed through the heat model,
    and the slowdowns solve a non-negative least squares for each time constant on a grid.
    They are then scaled by ``elasticity`` (``fit_gpu``): the share of the clock's slowdown
    that shows in step times."""
    design = _clock_design(data, timeline, clock, spec, hw)
    if design is None:
        return hw, {}
    best = None
    for tau in np.geomspace(0.1, 300.0, 60):
        X, y = _clock_rows(design, spec, hw, float(tau))
        coef = _nnls(X, y)
        err = float(np.sqrt(np.mean((X @ coef - y) ** 2)))
        if best is None or err < best[0]:
            best = (err, float(tau), coef)
    err, tau, (beta_fit, alpha_fit) = best
    beta, alpha = (x * elasticity if x * elasticity > 1e-9 else 0.0 for x in (beta_fit, alpha_fit))
    hw = dataclasses.replace(hw, clock_power_slowdown=float(f"{beta:.4g}"),
                             clock_heat_slowdown=float(f"{alpha:.4g}"), clock_tau_s=float(f"{tau:.4g}"))
    return hw, {"clock slowdown rms": err, "samples": float(len(y)),
                "clock power slowdown": float(beta_fit), "clock heat slowdown": float(alpha_fit),
                "elasticity": elasticity}


# ---------------------------------------------------------------------------- CPU costs
def term_errors(steps: pd.DataFrame) -> pd.DataFrame:
    """Fit error per term group: the rows where that term dominates the step."""
    groups = {
        "linear + prefill attention (prefill steps)": steps["kind"] == "prefill",
        "decode, KV reads, CUDA graph (decode step 1)": (steps["kind"] == "decode") & (steps["step"] == 0),
        "advance_step (decode steps 2..k)": (steps["kind"] == "decode") & (steps["step"] > 0),
        "mixed prefill + decode": steps["kind"] == "mixed",
        "served steps, synthetic workloads": steps["kind"] == "served_step",
    }
    rows = []
    for term, mask in groups.items():
        e = steps.loc[mask, "rel_error"].abs()
        if len(e):
            rows.append({"term": term, "points": len(e), "median_abs_rel_error": e.median(),
                         "max_abs_rel_error": e.max()})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------- uncertainty
def bootstrap(data: pd.DataFrame, timeline: pd.DataFrame, clock: pd.DataFrame, spec: ModelSpec,
              base: HardwareSpec, hw: HardwareSpec, elasticity: float | None,
              fixed: dict[str, tuple[float, str]], resamples: int,
              seed: int = BOOTSTRAP_SEED) -> pd.DataFrame:
    """Each fitted coefficient's spread over ``resamples`` refits on rows drawn with
    replacement (seed ``seed``): the step rows for the GPU terms (each refit starts from the
    full fit), the served (or microbenchmark) rows of each kind for the CPU costs, and the
    loaded clock samples for the clock slowdowns (their time constant held at its fit).
    One row per coefficient: profile, coefficient, std, p2.5, p97.5, resamples."""
    rng = np.random.default_rng(seed)
    draws: dict[tuple[str, str], list[float]] = {}

    problem, _ = _step_problem(data, spec, base, elasticity, fixed)
    full = [math.log(getattr(hw, k)) for k, _, _ in problem.keys]
    if problem.elasticity is None:
        full.append(float(elasticity if elasticity is not None else 1.0))
    x_full = np.array(full)
    n = len(problem.shapes)
    for _ in range(resamples):
        weights = np.bincount(rng.integers(0, n, n), minlength=n).astype(float)
        x, _ = problem.solve([x_full], weights, tol=1e-8)
        fit_hw = problem.hw(x)
        for k, _, _ in problem.keys:
            draws.setdefault(("hardware", k), []).append(getattr(fit_hw, k))

    for _ in range(resamples):
        picks = [rng.choice(rows, len(rows)) for _, rows in
                 sorted(data.groupby("kind", sort=True).indices.items())]
        sample = data.iloc[np.concatenate(picks)]
        prof, _ = fit_overhead(sample, "bootstrap")
        for k, v in prof.items():
            if k.endswith("_us") and k != "api_per_token_us":
                draws.setdefault(("overhead", k), []).append(float(v))

    design = _clock_design(data, timeline, clock, spec, hw)
    if design is not None and (hw.clock_heat_slowdown or hw.clock_power_slowdown):
        X, y = _clock_rows(design, spec, hw, hw.clock_tau_s)
        scale = elasticity if elasticity is not None else 1.0
        for _ in range(resamples):
            i = rng.integers(0, len(y), len(y))
            beta, alpha = _nnls(X[i], y[i]) * scale
            draws.setdefault(("hardware", "clock_power_slowdown"), []).append(float(beta))
            draws.setdefault(("hardware", "clock_heat_slowdown"), []).append(float(alpha))

    rows = []
    for (group, key), values in draws.items():
        v = np.array(values)
        rows.append({"profile": group, "coefficient": key, "std": float(np.std(v, ddof=1)),
                     "p2.5": float(np.percentile(v, 2.5)),
                     "p97.5": float(np.percentile(v, 97.5)), "resamples": len(v)})
    return pd.DataFrame(rows, columns=["profile", "coefficient", "std", "p2.5", "p97.5",
                                       "resamples"])


__all__ = ["FIT_KEYS", "SHAPE_COLS", "STEP_KINDS", "UNDETERMINED",
           "bootstrap", "fit_clock", "fit_gpu", "fixed_terms",
           "measured_launch_us", "served_first_steps", "term_errors"]
