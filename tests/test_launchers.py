"""Sweeps under the submitit launchers (docs/sweeps.md): submitit_local runs a sweep whose
aggregate callback and skip_existing behave as under joblib; conf/hydra/launcher/slurm.yaml
reaches sbatch as documented."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
# a tiny simulated sweep: three runs of a few milliseconds each
SWEEP = ["workload=synthetic", "workload.num_prompts=10", "policy=multi_step",
         "policy.num_steps=1,2,4", "progress=false"]


def _sweep(cwd: Path, *overrides: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.run", "-m", *overrides],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=180)


def _results(sweep_dir: Path) -> dict[str, tuple[int, int]]:
    """Each run's result.json: (inode, mtime in ns); a rewritten result (written to a temporary
    file, then renamed) gets a new inode."""
    return {str(p.parent.relative_to(sweep_dir)): (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in sweep_dir.rglob("result.json")}


def test_slurm_launcher_config_reaches_sbatch(tmp_path):
    """hydra/launcher=slurm on a host without SLURM: stand-ins for srun (which submitit looks
    for) and sbatch (which keeps the job script and refuses it) show what a cluster gets."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = tmp_path / "job.sh"
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\ncp "$1" {script}\n'
                                    'echo "sbatch: error: not a cluster" >&2\nexit 1\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    sweep_dir = tmp_path / "shared" / "sweep"
    out = _sweep(tmp_path, "hydra/launcher=slurm", "hydra.launcher.partition=cpu_queue",
                 f"hydra.sweep.dir={sweep_dir}", *SWEEP, env=env)
    assert out.returncode != 0 and "not a cluster" in out.stderr
    sbatch = script.read_text()
    for line in ("--array=0-2%3", "--cpus-per-task=1", "--mem=4GB", "--partition=cpu_queue",
                 "--time=60", f"--output={sweep_dir}/.submitit/"):
        assert f"#SBATCH {line}" in sbatch, line
    # the job runs the submitting interpreter on the job files below the sweep directory
    assert f"{sys.executable} -u -m submitit.core._submit {sweep_dir}/.submitit/" in sbatch


def test_every_experiment_takes_every_launcher():
    """docs/sweeps.md swaps the launcher of a written-down sweep on the command line
    (+experiment=steps_sweep hydra/launcher=slurm): an experiment that set a launcher's own
    setting (joblib's n_jobs) in its body would refuse every other launcher."""
    from hydra import compose, initialize_config_dir

    from common.paths import conf_dir

    experiments = sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml"))
    assert experiments
    launchers = {"basic": "BasicLauncher", "joblib": "JoblibLauncher",
                 "submitit_local": "LocalLauncher", "slurm": "SlurmLauncher"}
    refused = []
    for name in experiments:
        for launcher, cls in launchers.items():
            with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
                try:
                    cfg = compose("config", overrides=[f"+experiment={name}",
                                                       f"hydra/launcher={launcher}"],
                                  return_hydra_config=True)
                except Exception as err:  # Hydra's composition errors come in several types
                    refused.append(f"{name} + {launcher}: {' '.join(str(err).split())}")
                    continue
            assert cfg.hydra.launcher._target_.endswith(cls), (name, launcher)
    assert not refused, "\n".join(refused)


# the two-run sweep both tests below read: a joblib sweep of two worker processes (n_jobs=2 on
# any number of cores), run once for the module
TWO_RUNS = [*SWEEP[:3], "policy.num_steps=1,2", "progress=false", "model=tiny", "hardware=cpu",
            "overhead=none"]


def _two_run_sweep(sweep: Path, launcher: str, *extra: str) -> subprocess.CompletedProcess:
    extra = (*extra, "hydra.launcher.n_jobs=2") if launcher == "joblib" else extra
    return _sweep(ROOT, *TWO_RUNS, f"hydra/launcher={launcher}", *extra,
                  f"hydra.sweep.dir={sweep}")


@pytest.fixture(scope="module")
def joblib_sweep(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    sweep = tmp_path_factory.mktemp("launchers") / "joblib"
    return sweep, _two_run_sweep(sweep, "joblib")


# timeout_min: a job that hangs is killed within a minute instead of holding CI;
# skip_existing: for the re-run (neither names a run directory nor changes what is printed)
SUBMITIT = ["hydra.launcher.timeout_min=1", "+skip_existing=true"]


@pytest.fixture(scope="module")
def submitit_sweep(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, list[str]]:
    """The two-run sweep under submitit_local, run once for the module (the re-run test runs
    it again): the sweep dir, the command's outcome and what .submitit held after it."""
    sweep = tmp_path_factory.mktemp("launchers") / "submitit_local"
    p = _two_run_sweep(sweep, "submitit_local", *SUBMITIT)
    return sweep, p, sorted(q.name for q in (sweep / ".submitit").iterdir())


def test_a_joblib_sweep_prints_and_logs_each_run_once(joblib_sweep):
    """A joblib worker's copy of the run's logger passed each line on to the root logger's
    console and file handlers too: each run's line was printed two or three times."""
    sweep, p = joblib_sweep
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [line for line in p.stdout.splitlines() if "req/s" in line]
    assert len(lines) == 2 and not any("[schedlab.run]" in line for line in lines), p.stdout
    assert "Serving Benchmark Result" not in p.stdout  # each summary is in its run.log only
    logs = list(sweep.glob("*/run.log"))
    assert len(logs) == 2
    for log in logs:
        assert log.read_text().count("Serving Benchmark Result") == 1


@pytest.mark.slow
def test_every_launcher_prints_one_line_per_run_and_the_aggregate(tmp_path, joblib_sweep,
                                                                  submitit_sweep):
    """basic, joblib and submitit_local print the same: each run's line (submitit's jobs print
    into their log files, so the sweep process prints their lines), the aggregate's path, and
    nothing else on stdout; submitit leaves no empty folder for its %j pattern."""
    outputs = {}
    for launcher in ("basic", "joblib", "submitit_local"):
        if launcher == "joblib":
            sweep, p = joblib_sweep
        elif launcher == "submitit_local":
            sweep, p, submitit_dirs = submitit_sweep
        else:
            sweep = tmp_path / launcher
            p = _two_run_sweep(sweep, launcher)
        assert p.returncode == 0, p.stderr[-2000:]
        lines = p.stdout.strip().splitlines()
        assert len(lines) == 3, (launcher, lines)
        assert sorted(line.split(":")[0] for line in lines[:2]) == [
            f"run {k} of 2 (hardware=cpu,model=tiny,overhead=none,"
            f"policy.num_steps={k},policy=multi_step,workload.num_prompts=10,"
            "workload=synthetic)" for k in (1, 2)], (launcher, lines)
        assert all("req/s, median TTFT" in line and f"-> {sweep}" in line for line in lines[:2])
        assert lines[2] == f"aggregated 2 runs -> {sweep / 'aggregate.csv'} (and .parquet)"
        outputs[launcher] = sorted(line.replace(str(sweep), "SWEEP") for line in lines)
    assert outputs["basic"] == outputs["joblib"] == outputs["submitit_local"]
    assert "%j" not in submitit_dirs and len(submitit_dirs) == 2  # a job each


@pytest.mark.slow
def test_submitit_local_sweep_aggregates_and_a_rerun_skips_every_run(submitit_sweep):
    sweep_dir, first, _ = submitit_sweep
    assert first.returncode == 0, first.stderr[-3000:]
    assert "aggregated 2 runs" in first.stdout
    table = pd.read_csv(sweep_dir / "aggregate.csv")
    assert len(table) == 2 and sorted(table["k"]) == [1, 2]
    assert set(table["policy"]) == {"multi_step"} and (table["completed"] == 10).all()
    # each run ran in a submitit job of its own (its log below the sweep dir), not in-process
    logs = sorted((sweep_dir / ".submitit").glob("*/*_0_log.out"))
    assert len(logs) == 2
    done = _results(sweep_dir)
    assert len(done) == 2

    again = _two_run_sweep(sweep_dir, "submitit_local", *SUBMITIT)
    assert again.returncode == 0, again.stderr[-3000:]
    assert _results(sweep_dir) == done  # no result rewritten
    logs = sorted((sweep_dir / ".submitit").glob("*/*_0_log.out"))
    skipped = [p for p in logs if "skipping" in p.read_text()]
    assert len(logs) == 4 and len(skipped) == 2
    table = pd.read_csv(sweep_dir / "aggregate.csv")
    assert len(table) == 2 and sorted(table["k"]) == [1, 2]
