"""Leave-one-model-out validation: the fit never sees the held-out model, and the committed table
is what the command rebuilds."""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from experiments import host_speed, model_runs
from experiments import leave_one_out as loo
from experiments.fit_cpu import fit_overhead
from experiments.profiles import InputError
from experiments.validate import load_profile, run_one
from simulator.op_cost import launch_terms
from simulator.op_tables import load_tables

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("llama3_2_1b", "llama3_2_3b")
RATE = 20.0
TRUE_FACTORS = (1.1, 1.2)  # op_kernel_factor, op_compute_factor of the fixture's "GPU"


def _measure(root: Path, model: str, policy: str, k: int | None, rate: float) -> Path:
    """One fixture run: the simulator at known factors stands in for the GPU; its steps.csv
    in the real engine's columns."""
    hw = {**load_profile("hardware", "h200_ops"), "op_kernel_factor": TRUE_FACTORS[0],
          "op_compute_factor": TRUE_FACTORS[1]}
    ov = load_profile("overhead", "schedlab_h200")
    tag = f"{policy}_k{k or 1}" + ("" if math.isinf(rate) else f"_rate{rate:g}")
    run_dir = root / model / ("t0" if math.isinf(rate) else "poisson") / tag
    meas = {"num_prompts": 24, "seed": 0 if math.isinf(rate) else 1}
    runs = model_runs.ModelRuns(model, [], rate)
    run_one(loo.sim_overrides(runs, policy, k, rate, meas) + ["backend.num_blocks=4000"],
            run_dir, {"hardware": hw, "overhead": ov})
    s = pd.read_csv(run_dir / "steps.csv")
    s = s.assign(schedule_s=s["schedule_prepare_s"], prepare_s=0.0, launch_s=0.0,
                 pythonize_s=0.0, update_s=1e-6 * (20 + 0.5 * s["num_seqs"]))
    with gzip.open(run_dir / "steps.csv.gz", "wt") as f:
        s.to_csv(f, index=False)
    (run_dir / "steps.csv").unlink()
    return run_dir


def _build_tree(root: Path) -> Path:
    spec = []
    for model in MODELS:
        for policy, k in model_runs.POLICIES:
            _measure(root, model, policy, k, math.inf)
        _measure(root, model, "single_step", None, RATE)
        spec.append({"model": model, "dirs": [f"{model}/t0", f"{model}/poisson"], "rate": RATE,
                     "steps": {f"{p}_k{k or 1}": f"{model}/t0/{p}_k{k or 1}/steps.csv.gz"
                               for p, k in model_runs.POLICIES},
                     "poisson_steps": [f"{model}/poisson/*/steps.csv.gz"]})
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    return root


@pytest.fixture(scope="module")
def built_tree(tmp_path_factory) -> Path:
    """The fixture runs, made once for the module and never changed: a test that changes its
    runs works on a copy."""
    return _build_tree(tmp_path_factory.mktemp("measured"))


@pytest.fixture(scope="module")
def fixture_tree(built_tree, tmp_path_factory) -> Path:
    import shutil

    return Path(shutil.copytree(built_tree, tmp_path_factory.mktemp("measured") / "tree"))


@pytest.mark.slow
def test_calibrate_ops_fits_the_operator_profile_on_served_windows(built_tree, tmp_path,
                                                                    capsys):
    """`experiments.calibrate --ops --data TABLES` on served runs made at known factors writes a
    profile with those factors, the tables it fitted with and the engine's graph settings; a fit
    that cannot price the runs is flagged."""
    import shutil

    from experiments import calibrate

    root = Path(shutil.copytree(built_tree, tmp_path / "measured"))
    conf = tmp_path / "conf"
    tables = conf / "calibration" / "mine"  # outside conf/: the profile names it absolutely
    shutil.copytree(ROOT / "conf" / "calibration" / "h200_ops", tables)
    args = ["--ops", "--data", str(tables), "--spec", str(root / "spec.yaml"), "--conf-dir",
            str(conf), "--runs", str(tmp_path / "runs"), "--name", "mine"]
    calibrate.main(args)
    text = (conf / "hardware" / "mine.yaml").read_text()
    prof = yaml.safe_load(text)
    assert prof["op_kernel_factor"] == pytest.approx(TRUE_FACTORS[0], rel=0.02)
    assert prof["op_compute_factor"] == pytest.approx(TRUE_FACTORS[1], rel=0.05)
    assert prof["op_tables"] == str(tables.resolve()) and prof["num_sms"] == 132
    assert (prof["prefill_graph_max_tokens"], prof["piecewise_graph_max_tokens"]) == (512, 2048)
    assert "numpy " in text and f"{', '.join(MODELS)}" in text  # versions and the fitted runs
    assert "WARNING" not in text
    # the same path, other tables (GEMMs 3x slower): fitted from them, not from cached runs
    g = pd.read_csv(tables / "gemm.csv")
    g.assign(time_us=g["time_us"] * 3).to_csv(tables / "gemm.csv", index=False)
    load_tables.cache_clear()  # a process reads a table directory once (a command: one read)
    launch_terms.cache_clear()
    calibrate.main(args)
    text = (conf / "hardware" / "mine.yaml").read_text()
    assert yaml.safe_load(text)["op_kernel_factor"] < 0.9 * TRUE_FACTORS[0]
    assert "WARNING: the fit misses a model's summed GPU time by" in text
    capsys.readouterr()
    for bad, message in (
            (["--ops", "--data", str(tmp_path / "nope")],
             f"--data {tmp_path / 'nope'}: not a directory of operator tables"),
            (["--ops", "--bootstrap", "5"], "--bootstrap does not apply to --ops"),
            (["--spec", "x.yaml"], "--spec applies to --ops only"),
            (["--ops", "--name", "../x"],
             "--name '../x': not a plain profile name (letters, digits, _ . -)")):
        with pytest.raises(SystemExit) as exc:
            calibrate.main(bad + ["--conf-dir", str(conf)])
        assert exc.value.code == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"error: {message}"]


@pytest.mark.slow
def test_committed_operator_profile_is_its_refit(tmp_path):
    """conf/hardware/h200_ops.yaml is what `python -m experiments.calibrate --ops --data
    conf/calibration/h200_ops` writes from the committed tables and served runs."""
    from experiments import calibrate

    conf = tmp_path / "conf"
    calibrate.main(["--ops", "--data", str(ROOT / "conf" / "calibration" / "h200_ops"),
                    "--conf-dir", str(conf), "--runs", str(tmp_path / "runs")])
    assert yaml.safe_load((conf / "hardware" / "h200_ops.yaml").read_text()) == load_profile(
        "hardware", "h200_ops")


def _poison(root: Path, model: str) -> None:
    """The held-out model's served windows made nonsense: GPU times x 3, CPU phases x 5."""
    for f in (root / model).rglob("steps.csv.gz"):
        s = pd.read_csv(f)
        s = s.assign(gpu_s=s["gpu_s"] * 3, schedule_s=s["schedule_s"] * 5,
                     t_start=s["t_start"] * 2)
        with gzip.open(f, "wt") as out:
            s.to_csv(out, index=False)


def _scale_update(root: Path, model: str, by) -> None:
    """The model's update() timings times ``by`` (a number, or a column name of the steps)."""
    for f in (root / model).rglob("steps.csv.gz"):
        s = pd.read_csv(f)
        s = s.assign(update_s=s["update_s"] * (s[by] if isinstance(by, str) else by))
        with gzip.open(f, "wt") as out:
            s.to_csv(out, index=False)


@pytest.mark.slow
def test_folds_recover_the_factors_and_never_use_the_held_out_rows(fixture_tree, tmp_path):
    spec = model_runs.load_spec(str(fixture_tree / "spec.yaml"))
    work = tmp_path / "runs"
    df, fits = loo.leave_one_out(spec, None, [1.0], work, old=False)
    assert set(fits["held_out"]) == {*MODELS, "none"}
    for row in fits.itertuples():  # each fold sees only the other model, run at known factors
        assert row.fit_models == ";".join(sorted({*MODELS} - {row.held_out}))
        assert row.op_kernel_factor == pytest.approx(TRUE_FACTORS[0], rel=0.02)
        assert row.op_compute_factor == pytest.approx(TRUE_FACTORS[1], rel=0.05)
    # 2 models x (3 t=0 + 1 Poisson) x (3 medians + 4 tails)
    assert len(df) == 2 * 4 * (len(loo.TARGET_METRICS) + len(loo.TAIL_METRICS))
    assert set(df["host_scaling"]) == {loo.NO_SCALING} and (df["host_factor"] == 1.0).all()
    medians = df[df["metric"].isin(list(loo.TARGET_METRICS))]
    assert medians["rel_error"].abs().max() < 0.1  # the fixture's GPU is the op model itself
    assert df["measured"].notna().all() and df["predicted"].notna().all()
    t0 = df[df["request_rate"] == math.inf]
    assert t0["gpu_time_error"].notna().all() and t0["gpu_time_error"].abs().max() < 0.05
    assert df[df["request_rate"] == RATE]["gpu_time_error"].isna().all()
    # poison the held-out model's windows: its fold's fit and predictions do not move
    _poison(fixture_tree, MODELS[0])
    df2, fits2 = loo.leave_one_out(spec, None, [1.0], work, old=False)
    held = fits.set_index("held_out")
    held2 = fits2.set_index("held_out")
    pd.testing.assert_series_equal(held.loc[MODELS[0]], held2.loc[MODELS[0]])
    mine = df[df["model"] == MODELS[0]].reset_index(drop=True)
    mine2 = df2[df2["model"] == MODELS[0]].reset_index(drop=True)
    pd.testing.assert_series_equal(mine["predicted"], mine2["predicted"])
    # ... while the other fold, which fits on them, does
    assert held2.loc[MODELS[1], "op_kernel_factor"] > 1.5 * held.loc[MODELS[1],
                                                                      "op_kernel_factor"]
    # the predicted runs' own update() timings, 3x slower: by default nothing of a predicted
    # run but its configuration enters its prediction
    _scale_update(fixture_tree, MODELS[0], 3.0)
    df3, fits3 = loo.leave_one_out(spec, [MODELS[0]], [1.0], work, old=False)
    pd.testing.assert_series_equal(held2.loc[MODELS[0]], fits3.set_index("held_out").loc[MODELS[0]])
    pd.testing.assert_series_equal(mine2["predicted"],
                                   df3[df3["model"] == MODELS[0]].reset_index(drop=True)["predicted"])
    # the diagnostic reads them (its factor 3x), never into the reference its fold puts the
    # training runs' CPU costs on
    diag, fits4 = loo.leave_one_out(spec, [MODELS[0]], [1.0], work, old=False,
                                    per_run_host_factor=True)
    assert set(diag["host_scaling"]) == {loo.PER_RUN}
    assert diag["host_factor"].to_numpy() == pytest.approx(3.0, rel=0.02)
    assert not np.allclose(diag["predicted"], df3["predicted"])
    _scale_update(fixture_tree, MODELS[0], "num_seqs")
    _, fits5 = loo.leave_one_out(spec, [MODELS[0]], [1.0], work, old=False,
                                 per_run_host_factor=True)
    pd.testing.assert_series_equal(fits4.set_index("held_out").loc[MODELS[0]],
                                   fits5.set_index("held_out").loc[MODELS[0]])


@pytest.mark.slow
def test_predict_runs_measured_elsewhere_by_the_fold_that_holds_their_model_out(fixture_tree,
                                                                                tmp_path):
    """--predict: a model's runs copied to another tree (another host's measurement) get the
    predictions of the spec's own fold for that model, at every measured rate."""
    import shutil

    spec = model_runs.load_spec(str(fixture_tree / "spec.yaml"))
    other = tmp_path / "elsewhere"
    shutil.copytree(fixture_tree / MODELS[1], other / MODELS[1])
    targets = model_runs.predicted_runs(str(other), spec)
    assert [(r.model, r.rate) for r in targets] == [(MODELS[1], None)]
    assert "scheduler.max_num_seqs=256" in targets[0].overrides  # the runs' own config.json
    work = tmp_path / "runs"
    df, fits = loo.leave_one_out(spec, [MODELS[1]], [1.0], work, old=False)
    df2, fits2 = loo.leave_one_out(spec, None, [1.0], work, old=False, targets=targets)
    assert list(fits2["held_out"]) == ["none", MODELS[1]]
    pd.testing.assert_frame_equal(fits.reset_index(drop=True), fits2.reset_index(drop=True))
    pd.testing.assert_frame_equal(df.reset_index(drop=True), df2.reset_index(drop=True))
    assert set(df2["request_rate"]) == {math.inf, RATE}
    # measured on a host 1.3x slower at the scheduler's work: the same fold and, by default,
    # the same predictions; the diagnostic reads each run's own factor, 1.3x (the spec's runs
    # of the model, same-named directories, play no part)
    diag, _ = loo.leave_one_out(spec, None, [1.0], work, old=False, targets=targets,
                                per_run_host_factor=True)
    _scale_update(other, MODELS[1], 1.3)
    df3, fits3 = loo.leave_one_out(spec, None, [1.0], work, old=False, targets=targets)
    pd.testing.assert_frame_equal(fits.reset_index(drop=True), fits3.reset_index(drop=True))
    pd.testing.assert_frame_equal(df.reset_index(drop=True), df3.reset_index(drop=True))
    diag3, _ = loo.leave_one_out(spec, None, [1.0], work, old=False, targets=targets,
                                 per_run_host_factor=True)
    # (the factors are rounded to 4 decimals, and small against the poisoned reference above)
    assert (diag3["host_factor"] / diag["host_factor"]).to_numpy() == pytest.approx(1.3,
                                                                                    rel=1e-2)
    # runs measured with other scheduler settings than their neighbours are refused
    cfg = next((other / MODELS[1]).rglob("config.json"))
    c = yaml.safe_load(cfg.read_text())
    cfg.write_text(json.dumps({**c, "scheduler": {**c["scheduler"], "max_num_seqs": 8}}))
    with pytest.raises(SystemExit, match="different scheduler settings"):
        model_runs.predicted_runs(str(other), spec)


def test_time_split_compares_gpu_time_and_the_cpu_time_between_windows(tmp_path):
    """Measured: three windows of 10 ms GPU with 2 ms between them; simulated: 11 ms GPU and
    1 ms between (averaged over two runs)."""
    measured = pd.DataFrame({"t_start": [0.0, 0.012, 0.024], "gpu_s": [0.010] * 3})
    dirs = []
    for i, (gpu, gap) in enumerate([(0.011, 0.0005), (0.011, 0.0015)]):
        d = tmp_path / f"ts{i}"
        d.mkdir()
        pd.DataFrame({"t_start": [0.0, gpu + gap, 2 * (gpu + gap)], "gpu_s": [gpu] * 3}).to_csv(
            d / "steps.csv", index=False)
        dirs.append(d)
    split = loo.time_split(measured, dirs)
    assert split["gpu_time_error"] == pytest.approx(0.1)
    assert split["cpu_time_error"] == pytest.approx(-0.5)
    assert split["cpu_share"] == pytest.approx(0.004 / 0.034)


def test_cli_errors_are_one_line(tmp_path, capsys):
    """The command's bad inputs are one line on stderr and exit 2: the first from the command
    line itself, the rest through main() in this process (the same lines, without a new
    interpreter's imports each)."""
    out = subprocess.run([sys.executable, "-m", "experiments.leave_one_out", "--models", "nope",
                          "--out", str(tmp_path / "m"), "--runs", str(tmp_path / "r")],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: --models: nope not in the spec's models llama3_2_1b, llama3_2_3b, llama3_8b, "
        "llama2_13b, llama_30b"]

    def error_lines(*args: str) -> list[str]:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exc:
            loo.main([*args, "--out", str(tmp_path / "m"), "--runs", str(tmp_path / "r")])
        assert exc.value.code == 2
        return capsys.readouterr().err.strip().splitlines()

    (tmp_path / "runs_of" / "gpt2").mkdir(parents=True)
    assert error_lines("--predict", str(tmp_path / "runs_of")) == [
        f"error: --predict {tmp_path / 'runs_of'}: gpt2 is not a conf/model name"]
    (tmp_path / "runs_of" / "gpt2").rmdir()
    (tmp_path / "runs_of" / "llama3_2_1b" / "t0").mkdir(parents=True)
    assert error_lines("--predict", str(tmp_path / "runs_of")) == [
        f"error: llama3_2_1b: no steps file (steps.csv.gz) of its runs in "
        f"{tmp_path / 'runs_of' / 'llama3_2_1b' / 't0'}"]
    bad = tmp_path / "spec.yaml"
    bad.write_text("- model: x\n  colour: red\n")
    lines = error_lines("--spec", str(bad))
    assert len(lines) == 1 and lines[0].startswith(f"error: --spec {bad}: ")
    assert error_lines("--no-host-speed") == [
        "error: --no-host-speed is gone: no per-run host factor is the default "
        "(--per-run-host-factor is the diagnostic that reads it)"]


def _result(path: Path, ttfts: list[float], e2els: list[float], output_lens: list[int],
            errors: list[str] | None = None, lists_beside: bool = False, **keys) -> Path:
    """A result.json with its per-request lists inside it (the simulator's), or beside it in
    per_request.json.gz (a measured run's), or none."""
    path.mkdir(parents=True, exist_ok=True)
    lists = {"ttfts": ttfts, "e2els": e2els, "output_lens": output_lens,
             "errors": errors or [""] * len(ttfts)}
    if lists_beside:
        with gzip.open(path / "per_request.json.gz", "wt") as f:
            json.dump(lists, f)
    (path / "result.json").write_text(json.dumps({**keys, **({} if lists_beside or not ttfts
                                                             else lists)}))
    return path / "result.json"


def test_tail_latencies_from_the_file_or_its_per_request_lists(tmp_path):
    """p90/p99 TTFT and TPOT as the metrics code computes them: completed requests only, TPOT
    (e2el - ttft) / (output_len - 1) over requests with more than one token; the file's own
    keys first; NaN where the lists were stripped."""
    ttfts = [0.1 * i for i in range(1, 11)] + [99.0]  # the last one failed: left out
    e2els = [t + 0.01 * 9 for t in ttfts]
    lens = [10] * 10 + [0]
    errors = [""] * 10 + ["unfinished"]
    want = {"p90_ttft_ms": 1000 * float(np.percentile(ttfts[:10], 90)),
            "p99_ttft_ms": 1000 * float(np.percentile(ttfts[:10], 99)),
            "p90_tpot_ms": pytest.approx(10.0), "p99_tpot_ms": pytest.approx(10.0)}
    inside = _result(tmp_path / "sim", ttfts, e2els, lens, errors)
    assert model_runs.tail_latencies(inside) == want
    beside = _result(tmp_path / "meas", ttfts, e2els, lens, errors, lists_beside=True,
                     p99_ttft_ms=5.0)  # the file's own p99 wins
    assert model_runs.tail_latencies(beside) == {**want, "p99_ttft_ms": 5.0}
    stripped = _result(tmp_path / "grid", [], [], [], p99_ttft_ms=5.0, p99_tpot_ms=2.0)
    got = model_runs.tail_latencies(stripped)
    assert (got["p99_ttft_ms"], got["p99_tpot_ms"]) == (5.0, 2.0)
    assert math.isnan(got["p90_ttft_ms"]) and math.isnan(got["p90_tpot_ms"])
    # repeats: the mean of each file's; a repeat without lists leaves the tail unknown
    tails = model_runs.measured_tails({"files": [str(inside), str(beside)]})
    assert tails["p99_ttft_ms"] == pytest.approx((want["p99_ttft_ms"] + 5.0) / 2)
    assert math.isnan(model_runs.measured_tails({"files": [str(inside),
                                                           str(stripped)]})["p90_ttft_ms"])
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(InputError, match="bad.json: cannot read the result"):
        model_runs.tail_latencies(tmp_path / "bad.json")


def test_markdown_counts_the_cells_and_says_which_table_it_is():
    """The headline counts medians and p90s apart; a tail that could not be computed is n/a,
    counted as such and named; a diagnostic table says so in its title and text."""
    rows = []
    for model, rate, errs in (("a", math.inf, (0.01, 0.05, 0.2, 0.1, 0.2, 0.5, 0.5)),
                              ("b", 2.0, (0.05, 0.01, 0.01, math.nan, 0.01, 0.3, 0.3))):
        for (metric, target), e in zip({**loo.TARGET_METRICS, **loo.TAIL_METRICS}.items(), errs,
                                       strict=True):
            rows.append({"model": model, "policy": "cp1", "k": 8, "request_rate": rate,
                         "metric": metric, "profile": loo.NEW, "predicted": 1 + e,
                         "measured": math.nan if e != e else 1.0, "rel_error": e,
                         "target": target, "over_target": target is not None and abs(e) > target,
                         "host_scaling": loo.NO_SCALING, "host_factor": 1.0})
    df = pd.DataFrame(rows)
    fits = pd.DataFrame([{"held_out": "a", "op_kernel_factor": 1.0}])
    text = loo.markdown(df, fits, "cmd")
    assert ("h200_ops (held out): 4 of 6 cells within target (request throughput 3%, median "
            "TTFT and median TPOT 10%); 1 of 1 p90 TTFT cells within 15% (1 not computable); "
            "1 of 2 p90 TPOT cells within 15%.") in text
    assert "| a | cp1 | 8 | t=0 | 1 | +10.0% | 1 | **+20.0%** | 1 | +50.0% |" in text
    assert "| b | cp1 | 8 | 2/s | n/a | n/a |" in text
    assert "neither the tail nor per-request lists to compute it from: b cp1 k=8 2/s." in text
    assert "nothing of the run it predicts" in text and "Diagnostic" not in text
    diag = loo.markdown(df.assign(host_scaling=loo.PER_RUN), fits, "cmd")
    assert "**Diagnostic, not a prediction** (`--per-run-host-factor`)" in diag


# ---------------------------------------------------------------------------- committed table
COMMITTED = ROOT / "docs" / "validation" / "models.csv"
COMMITTED_FIT = ROOT / "docs" / "validation" / "models_fit.csv"


def test_committed_cpu_fits_are_rebuilt_from_the_measured_windows():
    fits = pd.read_csv(COMMITTED_FIT).set_index("held_out")
    spec = model_runs.load_spec(None)
    assert set(fits.index) == {"none", *(r.model for r in spec)}
    windows = pd.concat([model_runs.served_windows(r) for r in spec], ignore_index=True)
    for model in fits.index:  # "none": no model held out; the runs' CPU times as measured
        ov, _ = fit_overhead(windows[windows["model"] != model], "x")
        for key, value in ov.items():
            if key.endswith("_us"):
                assert fits.loc[model, key] == pytest.approx(value, rel=1e-5, abs=1e-9), key


def test_the_profile_carries_the_all_model_fit():
    fit = pd.read_csv(COMMITTED_FIT).set_index("held_out").loc["none"]
    hw = load_profile("hardware", "h200_ops")
    for key in ("op_kernel_factor", "op_compute_factor"):
        assert hw[key] == pytest.approx(fit[key], rel=1e-6), key


def test_committed_table_row_is_rebuilt(tmp_path):
    """One configuration of the committed table, predicted again from the committed fold's
    coefficients (the full command refits and re-simulates every one: minutes)."""
    fits = pd.read_csv(COMMITTED_FIT).set_index("held_out")
    table = pd.read_csv(COMMITTED)
    model, policy, k = "llama3_2_1b", "multi_step", 8
    runs = next(r for r in model_runs.load_spec(None) if r.model == model)
    meas = model_runs.measured_configs(runs)[(policy, k, math.inf)]
    hw = {**load_profile("hardware", "h200_ops"), "name": f"h200_ops_without_{model}",
          "op_kernel_factor": float(fits.loc[model, "op_kernel_factor"]),
          "op_compute_factor": float(fits.loc[model, "op_compute_factor"])}
    ov = {**load_profile("overhead", "schedlab_h200"), "name": f"served_without_{model}",
          **{key: float(fits.loc[model, key]) for key in fits.columns if key.endswith("_us")}}
    want = table[(table["model"] == model) & (table["policy"] == policy) & (table["k"] == k)
                 & (table["profile"] == loo.NEW) & (table["request_rate"] == math.inf)]
    assert set(want["host_scaling"]) == {loo.NO_SCALING}  # the committed table reads no run
    rows = loo.predict_config(runs, policy, k, math.inf, meas, {"hardware": hw, "overhead": ov},
                              loo.time_scales(5, 0.01), tmp_path, loo.NEW)
    assert len(want) == len(loo.TARGET_METRICS) + len(loo.TAIL_METRICS)
    for row in rows:
        w = want[want["metric"] == row["metric"]].iloc[0]
        assert row["predicted"] == pytest.approx(w["predicted"], rel=1e-5)
        assert row["measured"] == pytest.approx(w["measured"], rel=1e-5)
    # its p90s: the measured run's result file has none; its per-request lists give them
    assert {r["metric"] for r in rows if r["measured"] == r["measured"]} == set(want["metric"])


def test_host_factor_is_how_slowly_a_run_ran_the_schedulers_python_work():
    """Two runs of the same windows, one on a host 1.5x slower at update(): their factors are
    1.5x apart, and dividing by them puts both runs' CPU costs on one reference host."""
    rng = __import__("numpy").random.default_rng(0)
    n = rng.integers(1, 256, 400)
    base = pd.DataFrame({"num_seqs": n, "num_prefill_seqs": 0, "k": 1,
                         "update_s": 1e-6 * (20 + 0.5 * n) * rng.uniform(0.95, 1.05, 400),
                         "gap_s": 1e-6 * (300 + 5 * n), "cpu_s": 1e-6 * (250 + 4 * n),
                         "pythonize_s": 1e-5})
    slow = base.assign(**{c: base[c] * 1.5 for c in ("update_s", "gap_s", "cpu_s", "pythonize_s")})
    w = host_speed.with_host_factors(pd.concat([base.assign(file="a"), slow.assign(file="b")],
                                        ignore_index=True))
    fa, fb = (w[w["file"] == f]["host_factor"].iloc[0] for f in "ab")
    assert fb / fa == pytest.approx(1.5, rel=0.02)
    # a fold's reference is its training runs ("a"): the held-out run's timings set its own
    # factor and nothing else
    fold = host_speed.with_host_factors(w, w["file"] == "a")
    assert fold.groupby("file")["host_factor"].first().to_dict() == pytest.approx(
        {"a": 1.0, "b": 1.5}, rel=0.02)
    odd = w.assign(update_s=w["update_s"].where(w["file"] == "a", w["update_s"] * w["num_seqs"]))
    odd_fold = host_speed.with_host_factors(odd, odd["file"] == "a")
    assert (odd_fold["host_factor"] == fold["host_factor"])[w["file"] == "a"].all()
    assert (host_speed.with_host_factors(odd)["host_factor"] != w["host_factor"])[w["file"] == "a"].all()
    ref = host_speed.on_reference_host(w)
    a, b = ref[ref["file"] == "a"], ref[ref["file"] == "b"]
    assert (b["gap_s"].to_numpy() / a["gap_s"].to_numpy()) == pytest.approx(1.0, rel=0.02)
    assert host_speed.scaled_overhead({"name": "x", "schedule_base_us": 100.0, "async_output_processing":
                                True}, 1.5) == {"name": "x", "schedule_base_us": 150.0,
                                                "async_output_processing": True}
