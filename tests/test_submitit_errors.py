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


def test_failed_run_under_submitit_local_is_one_error_line_and_exit_2(tmp_path):
    p = subprocess.run([sys.executable, "-m", "experiments.run", "-m",
                        "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=1",
                        f"hydra.sweep.dir={tmp_path}", "policy.num_steps=0,1",
                        "workload=synthetic", "workload.num_prompts=4", "model=tiny",
                        "hardware=cpu", "overhead=none", "progress=false"],
                       cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    err = p.stderr.strip().splitlines()
    # Hydra's line naming the run that failed, then the run's own error
    assert err[-1] == "error: policy.num_steps must be an integer >= 1, got 0", err
    assert len(err) == 2 and "policy.num_steps=0" in err[0], err
