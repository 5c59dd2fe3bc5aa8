"""The Hydra command lines help their user: --help is a screen (what the command does, its
groups, the docs), not Hydra's config dump; a misspelt key gets "did you mean ...?"; a bad value
in one job of a sweep stops the sweep before its first job runs (experiments/cli_checks.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from common.paths import conf_dir

ROOT = Path(__file__).resolve().parents[1]


def command(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "experiments.run", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_help_says_what_the_run_does_its_groups_and_the_docs_in_a_screen(tmp_path):
    out = command("--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("python -m experiments.run")  # Hydra's: "run is powered by Hydra"
    assert len(lines) < 50  # Hydra's default: every setting of the config, ~130 lines
    assert any(line.startswith("policy: ") and "multi_step" in line for line in lines)
    assert "docs/running.md" in out.stdout and "--cfg job" in out.stdout
    assert "scheduler:" not in out.stdout  # no config dump


def test_serve_help_names_the_server():
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose("serve", return_hydra_config=True)
    assert cfg.hydra.help.header.startswith("python -m experiments.serve")
    assert "docs/serving.md" in cfg.hydra.help.header


def test_a_misspelt_key_gets_did_you_mean(tmp_path):
    out = command("policy.num_step=3", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 1
    assert "use +policy.num_step=3" in out.stderr  # Hydra's own hint stays
    assert out.stderr.strip().splitlines()[-1] == "did you mean policy.num_steps?"


def test_a_bad_value_in_a_sweep_stops_it_before_its_first_job(tmp_path):
    """Before, jobs 1 and 2 ran (minutes, at full size) and job 3 failed when it started."""
    sweep = tmp_path / "sweep"
    out = command("-m", "policy.num_steps=1,2,0", "workload=synthetic", "workload.num_prompts=4",
                  f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip() == ("error: job 3 of 3 (policy.num_steps=0,workload=synthetic,"
                                  "workload.num_prompts=4): policy.num_steps must be an integer "
                                  ">= 1, got 0")
    assert not sweep.exists()  # no job ran, no directory made


def test_every_job_of_a_sweep_is_checked_with_its_own_groups():
    """Jobs choosing other config groups compose with them: a setting only one policy has
    (cp1's) is found in the job that chooses another (multi_step has no such key)."""
    from hydra.core.global_hydra import GlobalHydra

    from experiments.cli_checks import first_bad_job

    jobs = [["policy=cp1", "policy.num_steps=2"], ["policy=multi_step", "policy.num_steps=2"],
            ["policy=sjf", "policy.num_steps=2"]]
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        master = compose("config", return_hydra_config=True)
        loader = GlobalHydra.instance().config_loader()
        assert first_bad_job(loader, master, jobs[:2]) is None
        line = first_bad_job(loader, master, jobs)
    assert line is not None and line.startswith("error: job 3 of 3 (policy=sjf,policy.num_steps=2)")
