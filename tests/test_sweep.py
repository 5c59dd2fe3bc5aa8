"""The README's sweep commands: a Hydra multirun ends in one aggregated table, plots follow."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_steps_sweep_aggregates_skips_and_plots(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", "experiments.run", "-m", "+experiment=steps_sweep", f"hydra.sweep.dir={sweep}",
            "policy=multi_step,cp2", "policy.num_steps=1,4", "scheduler.overlap=false",
            "hardware=h200", "workload.num_prompts=60", "hydra.launcher.n_jobs=1"]
    p = run(*args)
    assert p.returncode == 0, p.stderr[-2000:]
    df = pd.read_csv(sweep / "aggregate.csv")
    assert len(df) == 4 and set(df["k"]) == {1, 4} and set(df["policy"]) == {"multi_step", "cp2"}
    assert (df["completed"] == 60).all() and (df["request_throughput"] > 0).all()
    assert len(pd.read_parquet(sweep / "aggregate.parquet")) == 4
    stamp = {p: p.stat().st_mtime_ns for p in sweep.rglob("result.json")}
    p = run(*args)  # a re-run skips the finished runs
    assert p.returncode == 0, p.stderr[-2000:]
    assert {p: p.stat().st_mtime_ns for p in sweep.rglob("result.json")} == stamp
    assert "skipping" in p.stdout
    from experiments import plot  # its command line: tests/test_run_reliability.py

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["plot", str(sweep / "aggregate.csv"), "--out",
                                 str(tmp_path / "f")])
        plot.main()
    assert list((tmp_path / "f").glob("reqs_vs_k_*.png")) and list((tmp_path / "f").glob("*.svg"))


def composed(*overrides: str):
    from hydra import compose, initialize_config_dir

    from common.paths import conf_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return compose("config", overrides=list(overrides))


def run_error(*overrides: str, run_dir: Path) -> str:
    """What the command line prints for a bad setting (its "error: " line: the message of the
    error run() raises, which must be one line), from run() in this process."""
    from experiments.run import RunDirError
    from experiments.run import run as run_in_process

    with pytest.raises((ValueError, OSError, TypeError, RunDirError)) as err:
        run_in_process(composed(*overrides), run_dir)
    assert "\n" not in str(err.value), str(err.value)
    return f"error: {err.value}"


def test_bad_settings_are_one_line_errors(tmp_path):
    """The first through the command line (its exit status and stderr), the others through
    run() in this process: the command prints the error run() raises as its one line."""
    p = run("-m", "experiments.run", "policy.num_steps=0", f"hydra.run.dir={tmp_path / 'r'}",
            "workload.num_prompts=10", "progress=false")
    assert p.returncode != 0
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "policy.num_steps" in err[0], err
    assert "Traceback" not in p.stderr
    for override, needle in [("workload.request_rate=-1", "workload.request_rate"),
                             ("scheduler.max_num_batched_tokens=0", "scheduler.max_num_batched_tokens"),
                             ("model=llama3_70b", "llama3_70b")]:
        line = run_error(override, "workload.num_prompts=10", "progress=false",
                         run_dir=tmp_path / "r")
        assert needle in line, (override, line)


def _strip_wall(res: dict) -> dict:
    ext = dict(res["schedlab"])
    for key in ("wall_seconds", "simulated_seconds_per_wall_second"):
        ext.pop(key)
    return {**{k: v for k, v in res.items() if k != "date"}, "schedlab": ext}


def test_main_command_is_deterministic(tmp_path):
    """README's main job twice: the same result.json but for wall time."""
    import json

    results = []
    for i in range(2):
        p = run("-m", "experiments.run", f"hydra.run.dir={tmp_path / str(i)}")
        assert p.returncode == 0, p.stderr[-2000:]
        assert "Serving Benchmark Result" in p.stdout
        results.append(json.loads((tmp_path / str(i) / "result.json").read_text()))
        assert (tmp_path / str(i) / "requests.csv").exists()
    assert results[0]["completed"] == 1000
    assert _strip_wall(results[0]) == _strip_wall(results[1])
    assert results[0]["schedlab"]["simulated_seconds_per_wall_second"] > 1


def test_real_backend_cpu_command(tmp_path):
    """The real engine's CPU acceptance command writes the same result files."""
    p = run("-m", "experiments.run", "backend=real", "model=tiny", "backend.device=cpu",
            "workload=synthetic", "workload.num_prompts=16", f"hydra.run.dir={tmp_path}")
    assert p.returncode == 0, p.stderr[-2000:]
    for name in ("result.json", "requests.csv", "steps.csv"):
        assert (tmp_path / name).stat().st_size > 0
    assert pd.read_csv(tmp_path / "requests.csv").shape[0] == 16
    import json

    from experiments.run import CUDA_ONLY_FIELDS

    res = json.loads((tmp_path / "result.json").read_text())
    assert res["backend"] == "schedlab-real" and res["tokenizer_id"] == "meta-llama/Meta-Llama-3-8B"
    texts = res["generated_texts"]  # the outputs decoded (random weights: any text)
    assert len(texts) == 16 and all(isinstance(t, str) and t for t in texts)
    for field in CUDA_ONLY_FIELDS:  # a CPU run's printout leaves out what only CUDA has
        assert f"{field}:" not in p.stdout and field in res["schedlab"]
    assert "device:" in p.stdout


def test_any_multirun_ends_in_an_aggregated_table(tmp_path):
    p = run("-m", "experiments.run", "-m", "policy.num_steps=1,2", "workload.num_prompts=30",
            "progress=false", f"hydra.sweep.dir={tmp_path}")
    assert p.returncode == 0, p.stderr[-2000:]
    df = pd.read_csv(tmp_path / "aggregate.csv")
    assert sorted(df["k"]) == [1, 2] and (df["completed"] == 30).all()
    # one line per run on the console; each run's full summary is its summary.txt
    assert "Serving Benchmark Result" not in p.stdout
    lines = [line for line in p.stdout.splitlines() if " req/s, median TTFT " in line]
    assert len(lines) == 2
    for k, line in zip((1, 2), lines, strict=True):
        run_dir = tmp_path / f"policy.num_steps={k},workload.num_prompts=30"
        # "run 1 of 2": the job's place in the sweep (a joblib sweep's lines come in any order)
        assert line.startswith(f"run {k} of 2 (policy.num_steps={k},") and \
            line.endswith(f"-> {run_dir}")
        assert "Serving Benchmark Result" in (run_dir / "summary.txt").read_text()


def test_a_sweep_s_size_is_the_product_of_its_swept_settings(monkeypatch):
    """What "run 3 of 12" counts: the jobs Hydra's sweeper makes of the experiment's params and
    the command line's overrides."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from common.paths import conf_dir
    from experiments.sweep_workers import SWEEP_JOBS_ENV, job_label, sweep_size

    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        router = compose("config", overrides=["+experiment=router_sweep"],
                         return_hydra_config=True)
        policy = compose("config", overrides=["+experiment=policy_sweep", "progress=false"],
                         return_hydra_config=True)
    assert sweep_size(router) == 6 * 3 * 4 and sweep_size(policy) == 8 * 5
    job = OmegaConf.create({"job": {"num": 2, "override_dirname": "policy=cp1"}})
    monkeypatch.setenv(SWEEP_JOBS_ENV, "40")  # as the sweep process sets it for its jobs
    assert job_label(job) == "run 3 of 40 (policy=cp1)"
    monkeypatch.delenv(SWEEP_JOBS_ENV)  # a launcher that passes no environment on
    assert job_label(job) == "run 3 (policy=cp1)"


def test_model_too_big_for_cpu_is_a_one_line_error(tmp_path):
    line = run_error("backend=real", "model=llama3_70b", "backend.device=cpu",
                     "workload.num_prompts=2", "progress=false", run_dir=tmp_path)
    assert "llama3_70b needs" in line


def test_measured_repeats_are_averaged_and_their_spread_kept(tmp_path):
    """Several result files of one configuration are repeats: each metric is their mean and the
    spread (max - min over mean) is kept; repeats of different workloads are refused."""
    import json

    from experiments.validate import measured_from_dir

    def vllm_file(name: str, thr: float, ttft: float, **extra) -> None:
        res = {"request_throughput": thr, "median_ttft_ms": ttft, "request_rate": 20,
               "num_scheduler_steps": 8, "num_prompts": 300, **extra}
        (tmp_path / name).write_text(json.dumps(res))

    vllm_file("a.json", 10.0, 30.0)
    vllm_file("b.json", 12.0, 50.0)
    vllm_file("c.json", 5.0, 9.0, num_scheduler_steps=4)
    got = measured_from_dir(tmp_path)
    k8 = got[("multi_step", 8, 20.0)]
    assert k8["repeats"] == 2 and k8["request_throughput"] == pytest.approx(11.0)
    assert k8["median_ttft_ms"] == pytest.approx(40.0)
    assert k8["spread"]["median_ttft_ms"] == pytest.approx(0.5)
    k4 = got[("multi_step", 4, 20.0)]
    assert k4["repeats"] == 1 and k4["spread"]["median_ttft_ms"] != k4["spread"]["median_ttft_ms"]
    vllm_file("e.json", 7.0, 11.0, num_scheduler_steps=4, seed="0")  # metadata as text: the same
    assert measured_from_dir(tmp_path)[("multi_step", 4, 20.0)]["repeats"] == 2
    vllm_file("d.json", 11.0, 40.0, num_prompts=1000)
    with pytest.raises(ValueError, match="different num_prompts"):
        measured_from_dir(tmp_path)


def test_repeats_with_different_kv_caches_must_predict_alike(tmp_path):
    """Repeats measured with KV caches a few blocks apart are simulated with each cache; they are
    one measurement only where every cache gives the same prediction."""
    import argparse
    import json
    import math

    from experiments.calibrate import load_conf
    from experiments.validate import config_overrides, measured_from_dir, predict

    for name, blocks in (("a", 4096), ("b", 4100)):
        (tmp_path / f"{name}.json").write_text(json.dumps(
            {"request_throughput": 1.0, "schedlab": {
                "policy": "multi_step", "k": 4, "num_blocks": blocks,
                "workload": {"kind": "synthetic", "request_rate": "inf", "num_prompts": 40,
                             "seed": 0}}}))
    assert measured_from_dir(tmp_path)[("multi_step", 4, math.inf)]["cache_sizes"] == [4096, 4100]
    args = argparse.Namespace(model="tiny", workload="synthetic", override=[])
    profiles = {"hardware": load_conf("hardware", "cpu"), "overhead": load_conf("overhead", "none")}
    sim = config_overrides("multi_step", 4, math.inf, args, 40, 0) + ["backend=sim"]
    runs = tmp_path / "runs"
    same = predict(sim, runs / "roomy", profiles, [4096, 4100], [1.0])
    assert {p.name for p in runs.iterdir()} == {"roomy_nb4096", "roomy_nb4100"}
    assert same["request_throughput"] > 0
    with pytest.raises(SystemExit, match="predicts different results"):
        predict(sim, runs / "tight", profiles, [4096, 100], [1.0])  # 100 blocks: the cache binds


def test_simulated_repeats_average_runs_over_time_scales(tmp_path):
    """The prediction is the mean of runs at time scales spread evenly over 1 +- spread, with
    their spread kept beside the measurement's."""
    import argparse
    import json
    import math

    from experiments.calibrate import load_conf
    from experiments.validate import config_overrides, predict, time_scales

    assert time_scales(1, 0.01) == [1.0]
    assert time_scales(3, 0.01) == pytest.approx([0.99, 1.0, 1.01])
    for bad in ((0, 0.01), (3, -0.1), (3, 0.5)):
        with pytest.raises(ValueError, match="--sim-repeats"):
            time_scales(*bad)
    args = argparse.Namespace(model="tiny", workload="synthetic", override=[])
    profiles = {"hardware": load_conf("hardware", "cpu"), "overhead": load_conf("overhead", "none")}
    sim = config_overrides("multi_step", 4, 30.0, args, 30, 0) + ["backend=sim"]
    got = predict(sim, tmp_path / "k4", profiles, [], [0.9, 1.1])
    runs = [json.loads((tmp_path / f"k4_ts{s}" / "result.json").read_text())
            for s in ("0.9", "1.1")]
    ttft = [r["median_ttft_ms"] for r in runs]
    assert runs[1]["schedlab"]["time_scale"] == 1.1  # each run at its own scale
    assert runs[1]["duration"] > runs[0]["duration"]
    assert got["repeats"] == 2 and got["median_ttft_ms"] == pytest.approx(sum(ttft) / 2)
    assert got["spread"]["median_ttft_ms"] == pytest.approx(abs(ttft[1] - ttft[0]) * 2 / sum(ttft))
    assert all(math.isfinite(v) for v in got["spread"].values())


def test_overlap_run_says_so_in_the_aggregate(tmp_path):
    """A run with scheduler.overlap=true is marked as such in its aggregate row, so figures draw
    overlap on and off as two series (tests/test_plot.py checks the drawing)."""
    from experiments.aggregate import aggregate
    from experiments.run import run as run_in_process

    run_in_process(composed("policy=single_step", "scheduler.overlap=true", "workload=synthetic",
                            "workload.num_prompts=4", "model=tiny", "hardware=cpu",
                            "overhead=none", "progress=false"), tmp_path / "run")

    assert aggregate(tmp_path / "run")["overlap"].tolist() == [True]
