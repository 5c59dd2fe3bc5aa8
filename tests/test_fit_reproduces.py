"""The calibration fit reproduces: the committed CSVs refit to the committed profiles, a fit on
step times made from known coefficients recovers them, and the held terms come from the data."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from experiments import calibrate
from experiments.fit import (
    FIT_KEYS,
    STEP_KINDS,
    _shape,
    _slowdowns,
    fit_gpu,
    fixed_terms,
    measured_launch_us,
    served_first_steps,
)
from policies import ModelSpec
from simulator.cost_model import piecewise_tokens, step_time
from simulator.hardware import HardwareSpec

CONF = Path(__file__).resolve().parents[1] / "conf"
DATA = CONF / "calibration" / "h200_calibrated.csv"
MODEL = ModelSpec.from_dict(yaml.safe_load((CONF / "model" / "llama3_8b.yaml").read_text()))
# the datasheet profile with the engine's graph sizes, as calibrate sets them from the data
H200 = dataclasses.replace(
    HardwareSpec.from_dict(yaml.safe_load((CONF / "hardware" / "h200.yaml").read_text())),
    prefill_graph_max_tokens=512, piecewise_graph_max_tokens=2048)


@pytest.fixture(scope="module")
def data() -> pd.DataFrame:
    return pd.read_csv(DATA)


def assert_same_profile(got: dict, committed: dict) -> None:
    assert set(got) == set(committed)
    for key, value in committed.items():
        if isinstance(value, float):
            assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key
        else:
            assert got[key] == value, key


@pytest.mark.slow
def test_refitting_the_committed_data_gives_the_committed_profiles(tmp_path):
    """`python -m experiments.calibrate --data conf/calibration/h200_calibrated.csv` into
    another conf dir writes the committed hardware and overhead profiles, to 1e-6."""
    out = calibrate.main(["--data", str(DATA), "--conf-dir", str(tmp_path), "--bootstrap", "0"])
    for group, name in (("hardware", "h200_calibrated"), ("overhead", "schedlab_h200")):
        committed = yaml.safe_load((CONF / group / f"{name}.yaml").read_text())
        assert_same_profile(yaml.safe_load((tmp_path / group / f"{name}.yaml").read_text()),
                            committed)
    assert not (tmp_path / "calibration").exists()  # --bootstrap 0: no spread written
    header = (CONF / "hardware" / "h200_calibrated.yaml").read_text()
    assert "numpy " in header and "scipy " in header
    for key in out["fixed"]:
        assert f"  {key} = " in header


def test_the_committed_uncertainty_covers_every_fitted_coefficient(data):
    spread = pd.read_csv(CONF / "calibration" / "h200_calibrated.uncertainty.csv")
    hw = yaml.safe_load((CONF / "hardware" / "h200_calibrated.yaml").read_text())
    oh = yaml.safe_load((CONF / "overhead" / "schedlab_h200.yaml").read_text())
    fixed = fixed_terms(data, MODEL, H200)
    fitted = {k for k, _, _ in FIT_KEYS if k not in fixed}
    got = spread.groupby("profile")["coefficient"].apply(set)
    assert got["hardware"] >= fitted | {"clock_heat_slowdown"}
    assert got["overhead"] >= {"schedule_base_us", "schedule_per_seq_us", "output_base_us"}
    for r in spread.itertuples():
        value = (hw if r.profile == "hardware" else oh)[r.coefficient]
        assert r.value == pytest.approx(value, rel=1e-5, abs=1e-12)
    assert (spread["p2.5"] <= spread["p97.5"]).all() and (spread["std"] >= 0).all()
    assert (spread["resamples"] == 200).all()
    # the step-time coefficients are pinned to a few percent by 3800 steps
    core = spread[spread["coefficient"].isin(["matmul_efficiency", "mem_bw_efficiency"])]
    assert (core["std"] / core["value"] < 0.05).all()


def synthetic_steps(data: pd.DataFrame, truth: HardwareSpec, noise: float) -> pd.DataFrame:
    """The committed data's step shapes and clocks (every microbenchmark step, every tenth
    served step) with times from the cost model at ``truth``, times lognormal noise."""
    steps = data[data["kind"].isin(STEP_KINDS)]
    steps = pd.concat([steps[steps["kind"] != "served_step"],
                       steps[steps["kind"] == "served_step"].iloc[::10]], ignore_index=True)
    slows = _slowdowns(steps)
    times = np.array([step_time(_shape(r), MODEL, truth, w)
                      for r, w in zip(steps.itertuples(), slows, strict=True)])
    rng = np.random.default_rng(0)
    return steps.assign(gpu_s=times * np.exp(rng.normal(0.0, noise, len(times))))


TRUTH = {"matmul_efficiency": 0.8, "mem_bw_efficiency": 0.72, "attn_prefill_efficiency": 0.25,
         "attn_decode_efficiency": 0.7, "roofline_exponent": 1.8, "attn_seq_gbps": 130.0,
         "cuda_graph_replay_us": 60.0}
HELD = {"kernel_launch_us": 40.0, "mixed_kernels_per_layer": 0.0, "advance_step_us": 0.0,
        "sampler_us": 0.0}


@pytest.mark.parametrize("noise,tolerance", [(0.0, 1e-4), (0.03, 0.05)])
def test_fit_on_synthetic_steps_recovers_the_coefficients(data, noise, tolerance):
    """Step times made by the cost model from known coefficients, on the shapes of a real
    calibration: the fit recovers every free coefficient to 1e-4 without noise, and to 5%
    with 3% noise on each step (the replay term, a small part of any step, to 15%)."""
    truth = dataclasses.replace(H200, **TRUTH, **HELD)
    rows = synthetic_steps(data, truth, noise)
    hw, steps, elasticity = fit_gpu(rows, MODEL, H200, 1.0,
                                    fixed={k: (v, "given") for k, v in HELD.items()})
    assert elasticity == 1.0
    for key, value in TRUTH.items():
        tol = 3 * tolerance if key == "cuda_graph_replay_us" else tolerance
        assert getattr(hw, key) == pytest.approx(value, rel=tol), key
    for key, value in HELD.items():
        assert getattr(hw, key) == value
    if noise == 0.0:
        assert steps["rel_error"].abs().max() < 1e-6


def test_kernel_launch_us_is_measured_on_served_piecewise_windows(data):
    """The launch cost is not fitted where served launch times exist: it is the median, over
    served piecewise windows, of each window's launch time per launch the cost model counts
    for it (L + 1 replays and L n_e eager kernels, n_e as the engine launches them), and it
    follows the data."""
    L = MODEL.num_layers
    launch = measured_launch_us(data, MODEL, H200)
    assert launch == pytest.approx(34.49, rel=1e-3)
    doubled = data.assign(launch_s=data["launch_s"] * 2)
    assert measured_launch_us(doubled, MODEL, H200) == pytest.approx(2 * launch, rel=1e-3)
    assert fixed_terms(data, MODEL, H200)["kernel_launch_us"][0] == launch
    # the engine's counts give mixed windows (5 a layer) and prefill-only ones (3) one launch
    # cost between them (a count of 4 for both would put them 30% apart)
    steps = served_first_steps(data)
    piecewise = steps[[piecewise_tokens(_shape(r), H200) is not None
                       for r in steps.itertuples()]]
    mixed = piecewise["num_prefill_tokens"].between(1, piecewise["num_tokens"] - 1)
    only_prefill = piecewise["num_prefill_tokens"] == piecewise["num_tokens"]
    assert mixed.sum() > 50 and only_prefill.sum() > 20
    per_mixed = piecewise.loc[mixed, "launch_s"].median() / (6 * L + 1) * 1e6
    per_prefill = piecewise.loc[only_prefill, "launch_s"].median() / (4 * L + 1) * 1e6
    assert per_mixed == pytest.approx(launch, rel=0.05)
    assert per_prefill == pytest.approx(launch, rel=0.05)
    # older data, without served windows: the launch cost is fitted
    assert measured_launch_us(data[data["kind"] != "served"], MODEL, H200) is None
    assert "kernel_launch_us" not in fixed_terms(data[data["kind"] != "served"], MODEL, H200)


def test_a_served_window_whose_decode_attention_splits_counts_the_merge_launches():
    """Each window is priced per launch it makes: with few decoding sequences (their keys
    split) a mixed piecewise window launches (L + 1) + 6 L, not (L + 1) + 5 L."""
    L = MODEL.num_layers
    hw = dataclasses.replace(H200, decode_split_kernels_per_layer=1.0)
    rows = []
    for i in range(12):
        decoding = 20 if i % 3 else 100  # 20 x 8 KV heads < 2 x 132 SMs: split; 100: not
        units = L + 1 + (6 if decoding == 20 else 5) * L
        shape = {"k": 1, "num_tokens": 170 + decoding, "num_seqs": 1 + decoding,
                 "num_prefill_tokens": 170, "num_sampled": 1 + decoding,
                 "attn_pairs": 14535.0, "kv_tokens": 170 + 300 * decoding, "is_first": True,
                 "max_kv_tokens": 300, "policy": "chunked_prefill", "served_window": i}
        rows.append({"kind": "served_step", "step": 0, "gpu_s": 0.01, **shape})
        rows.append({"kind": "served", "launch_s": units * 50e-6, **shape})
    data = pd.DataFrame(rows)
    assert measured_launch_us(data, MODEL, hw) == pytest.approx(50.0)
    # counted as if no window split, the split windows' launches look 17% slower each
    blind = dataclasses.replace(hw, decode_split_kernels_per_layer=0.0)
    assert measured_launch_us(data, MODEL, blind) == pytest.approx(
        50.0 * (7 * L + 1) / (6 * L + 1), rel=1e-3)


def test_one_bootstrap_resample_is_refused():
    with pytest.raises(SystemExit) as exc:
        calibrate.main(["--data", str(DATA), "--bootstrap", "1"])
    assert exc.value.code == 2


def test_missing_data_is_a_one_line_error_with_exit_code_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        calibrate.main(["--data", str(tmp_path / "absent.csv"), "--conf-dir", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "absent.csv" in err and "\n" not in err
