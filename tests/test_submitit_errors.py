"""A run that fails in a submitit sweep ends the command as under the other launchers: exit
code 2 and its one-line error, with no traceback."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

from experiments.run import RunExit, RunFailed

ROOT = Path(__file__).resolve().parents[1]


def test_a_failed_run_crosses_the_job_boundary_as_its_exit():
    """submitit keeps the job's exception in its pickled result; the sweep process gets the
    exit it stands for."""
    back = pickle.loads(pickle.dumps(RunFailed("error: policy.num_steps must be >= 1")))
    assert isinstance(back, RunExit) and back.code == 2
    assert back.message == "error: policy.num_steps must be >= 1"


def _submitit_sweep(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.run", "-m",
                           "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=1",
                           f"hydra.sweep.dir={tmp_path / 'sweep'}", *overrides,
                           "model=tiny", "hardware=cpu", "overhead=none", "progress=false"],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)


def test_failed_run_under_submitit_local_is_one_error_line_and_exit_2(tmp_path):
    """A run that fails when it runs (its trace is missing: no setting says so beforehand)."""
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_time,prompt_len,output_len\n0,10,4\n")
    missing = tmp_path / "missing.csv"
    p = _submitit_sweep(tmp_path, "workload=trace", f"workload.trace_path={missing},{trace}")
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    err = p.stderr.strip().splitlines()
    # Hydra's line naming the run that failed, then the run's own error
    assert err[-1].startswith("error: ") and str(missing) in err[-1], err
    assert len(err) == 2 and "missing.csv" in err[0], err


def test_a_bad_setting_under_submitit_local_stops_the_sweep_before_a_job_is_submitted(tmp_path):
    p = _submitit_sweep(tmp_path, "policy.num_steps=0,1", "workload=synthetic",
                        "workload.num_prompts=4")
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.strip().splitlines() == [
        "error: job 1 of 2 (policy.num_steps=0,workload=synthetic,workload.num_prompts=4,"
        "model=tiny,hardware=cpu,overhead=none,progress=False): policy.num_steps must be an "
        "integer >= 1, got 0"]
    assert not (tmp_path / "sweep").exists()  # nothing submitted
