"""A run or sweep never loses a user's file or writes outside its directory: settings are checked
before the run directory is touched, only files schedlab recorded writing there are removed, an
input the run would overwrite is refused, job directories stay inside the sweep dir; and a
sweep's jobs leave nothing behind in its process, nor print a line twice."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from experiments.run import CONF_DIR, run
from experiments.run_dir import (
    MANIFEST,
    RunDirCallback,
    RunDirError,
    _held,
    claim,
    safe_dirname,
)

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["backend=sim", "model=tiny", "hardware=cpu", "overhead=none", "progress=false"]
SYNTHETIC = ["workload=synthetic", "workload.num_prompts=8"]


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "experiments.run", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def one_line_error(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    return lines[0]


def composed(*overrides: str, hydra: bool = False):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra)


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def user_files(d: Path) -> dict[str, bytes]:
    (d / "summary.txt").write_text("my notes\n")
    (d / "requests.csv").write_text("my,own,table\n")
    return files(d)


# --- 2. data loss ------------------------------------------------------------------------------

def test_a_bad_setting_in_a_directory_of_user_files_touches_none_of_them(tmp_path):
    """The audit's command: results were cleared before the settings were checked."""
    mine = user_files(tmp_path)
    p = cli("workload=synthetic", "workload.num_prompts=-5", "hydra.run.dir=.", cwd=tmp_path)
    assert "workload.num_prompts" in one_line_error(p)
    assert {k: v for k, v in files(tmp_path).items() if k in mine} == mine


def test_result_named_files_schedlab_did_not_write_are_refused_not_replaced(tmp_path):
    mine = user_files(tmp_path)
    with pytest.raises(RunDirError, match="requests.csv, summary.txt.*hydra.run.dir"):
        run(composed(*SMALL, *SYNTHETIC), tmp_path)
    assert files(tmp_path) == mine


def test_a_rerun_removes_only_what_the_previous_run_recorded(tmp_path):
    cfg = composed(*SMALL, *SYNTHETIC)
    run(cfg, tmp_path)
    manifest = json.loads((tmp_path / MANIFEST).read_text())["files"]
    assert sorted(manifest) == ["requests.csv", "result.json", "steps.csv", "summary.txt"]
    (tmp_path / "notes.txt").write_text("kept\n")
    run(cfg, tmp_path)  # replaces its own results, leaves the rest
    assert (tmp_path / "notes.txt").read_text() == "kept\n"
    (tmp_path / "summary.txt").write_text("edited by hand\n")  # changed since: not ours now
    before = files(tmp_path)
    with pytest.raises(RunDirError, match="summary.txt"):
        run(cfg, tmp_path)
    assert files(tmp_path) == before


def test_the_manifest_holds_each_files_own_digest_and_a_csv_edited_since_is_refused(tmp_path):
    """requests.csv and steps.csv are hashed as their writers write them, not read again: the
    manifest's digest is still the file's own, and an edit (the same size) is still seen."""
    import hashlib

    cfg = composed(*SMALL, *SYNTHETIC)
    run(cfg, tmp_path)
    manifest = json.loads((tmp_path / MANIFEST).read_text())["files"]
    for name, entry in manifest.items():
        data = (tmp_path / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    text = (tmp_path / "requests.csv").read_bytes()
    time.sleep(0.05)  # (a clock tick of the file system's later, as any edit by hand is)
    (tmp_path / "requests.csv").write_bytes(text[:-2] + (b"0" if text[-2:-1] != b"0" else b"1")
                                            + text[-1:])
    before = files(tmp_path)
    with pytest.raises(RunDirError, match="requests.csv"):
        run(cfg, tmp_path)
    assert files(tmp_path) == before


def test_a_rerun_removes_the_copies_a_killed_run_left(tmp_path):
    """A run killed while it wrote (SIGKILL, the OOM killer: a long simulation writes
    requests.csv as it goes) leaves its files' temporary copies; the next run in the directory
    removes them, and nothing else of that look."""
    cfg = composed(*SMALL, *SYNTHETIC)
    (tmp_path / ".requests.csv.k1ll3d_x.tmp").write_text("request_id,arrival_time\n0,0.0\n")
    (tmp_path / ".result.json.k1ll3d_x.tmp").write_text("{")
    (tmp_path / ".notes.txt.k1ll3d_x.tmp").write_text("kept\n")  # not a result file's
    (tmp_path / ".requests.csv.mine.tmp").write_text("kept\n")  # not named as a copy is
    (tmp_path / ".steps.csv.abcd1234.tmp").mkdir()  # a directory
    run(cfg, tmp_path)
    assert not (tmp_path / ".requests.csv.k1ll3d_x.tmp").exists()
    assert not (tmp_path / ".result.json.k1ll3d_x.tmp").exists()
    assert (tmp_path / ".notes.txt.k1ll3d_x.tmp").read_text() == "kept\n"
    assert (tmp_path / ".requests.csv.mine.tmp").read_text() == "kept\n"
    assert (tmp_path / ".steps.csv.abcd1234.tmp").is_dir()


def test_an_input_the_run_would_overwrite_is_refused(tmp_path):
    """A trace named like a result, in the run dir: the user's own, or a previous run's
    requests.csv (schedlab's, recorded) replayed as a trace."""
    trace = tmp_path / "requests.csv"
    trace.write_text("arrival_time,prompt_len,output_len\n0,10,4\n0.5,20,4\n")
    cfg = composed(*SMALL, "workload=trace", "workload.format=csv", f"workload.trace_path={trace}")
    with pytest.raises(RunDirError, match=r"workload.trace_path=.*requests.csv.*a file this run"):
        run(cfg, tmp_path)
    assert trace.read_text().startswith("arrival_time,prompt_len,output_len\n0,10,4")
    out = tmp_path / "first"
    run(composed(*SMALL, *SYNTHETIC), out)
    own = (out / "requests.csv").read_bytes()
    with pytest.raises(RunDirError, match="workload.trace_path"):
        run(composed(*SMALL, "workload=trace", f"workload.trace_path={out / 'requests.csv'}"), out)
    assert (out / "requests.csv").read_bytes() == own


def test_an_empty_run_or_sweep_dir_is_refused(tmp_path):
    with pytest.raises(RunDirError, match="hydra.run.dir is empty"):
        claim("", "hydra.run.dir")
    p = cli(*SMALL, *SYNTHETIC, "hydra.run.dir=", cwd=tmp_path)
    assert "hydra.run.dir is empty" in one_line_error(p)
    assert list(tmp_path.iterdir()) == []


def test_a_sweep_keeps_a_users_aggregate_table(tmp_path, capsys):
    (tmp_path / "aggregate.csv").write_text("mine\n")
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    with pytest.raises(SystemExit) as exit_:
        RunDirCallback().on_multirun_start(config)
    assert exit_.value.code == 2 and "aggregate.csv" in capsys.readouterr().err
    assert (tmp_path / "aggregate.csv").read_text() == "mine\n"
    assert tmp_path.absolute() not in _held  # refused: the directory's lock is let go


# --- 3. job directories stay inside the sweep dir ---------------------------------------------

def test_job_directory_names_are_safe_and_ordinary_ones_unchanged():
    cfg = composed("policy.num_steps=8", "policy=cp1", hydra=True)
    assert OmegaConf.select(cfg, "hydra.sweep.subdir") == "policy.num_steps=8,policy=cp1"
    for text in ["workload.trace_path=x/../../../victim/t.csv", "..", "a=" + "b/" * 300,
                 "workload.name=a b\x00'\"*"]:
        name = safe_dirname(text)
        assert "/" not in name and name not in (".", "..") and len(name) <= 200
        assert name.isascii() and name.isprintable() and " " not in name
    # a changed name keeps a digest of the original: runs never share a directory
    assert safe_dirname("p=a/b") != safe_dirname("p=a_b") == "p=a_b"


def test_a_sweep_with_dots_in_an_override_writes_only_inside_its_sweep_dir(tmp_path):
    """The audit's command, run from DIR/a/b: the job directory's '..' parts led out."""
    root = tmp_path / "dir"
    (root / "a" / "b" / "x").mkdir(parents=True)
    (root / "victim").mkdir()
    (root / "victim" / "t.csv").write_text("arrival_time,prompt_len,output_len\n0,10,4\n")
    before = files(tmp_path)
    p = cli("-m", *SMALL, "workload=trace", "workload.trace_path=x/../../../victim/t.csv",
            f"hydra.sweep.dir={root / 's'}", cwd=root / "a" / "b")
    assert p.returncode == 0, p.stderr[-2000:]
    new = {k for k in files(tmp_path) if k not in before}
    assert new and all(k.startswith("dir/s/") for k in new), sorted(new)
    assert len(pd.read_csv(root / "s" / "aggregate.csv")) == 1


# --- 20. a sweep's process does not grow with its jobs ----------------------------------------

class KeepReturns(Callback):
    """Holds on to each job's return, as Hydra's sweeper does until the sweep ends."""

    kept: list[JobReturn] = []

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        KeepReturns.kept.append(job_return)


def test_a_sweeps_jobs_keep_no_config_in_its_process(tmp_path, monkeypatch):
    """Hydra's sweeper holds every job's return until the sweep ends; each held two deep
    copies of the job's config (~0.2 MB: 100 MB in a 500-job sweep)."""
    from experiments import run as run_module

    KeepReturns.kept.clear()
    monkeypatch.setattr(sys, "argv", [
        "run", "-m", *SMALL, *SYNTHETIC, "workload.seed=0,1,2", f"hydra.sweep.dir={tmp_path}",
        f"+hydra.callbacks.keep._target_={__name__}.KeepReturns",
        "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"])
    run_module._app()
    assert len(KeepReturns.kept) == 3
    sizes = [len(pickle.dumps(r)) for r in KeepReturns.kept]
    assert max(sizes) < 5_000, sizes  # was 21 kB pickled (~0.2 MB in memory)


def test_tables_of_a_standalone_aggregate_are_recorded_as_schedlabs(tmp_path, monkeypatch):
    """python -m experiments.aggregate DIR writes tables a later sweep into DIR may replace."""
    from experiments import aggregate
    from experiments.run_dir import AGGREGATE_FILES, unrecorded

    run_dir = tmp_path / "run"
    (run_dir).mkdir()
    (run_dir / "result.json").write_text(json.dumps(
        {"completed": 1, "request_throughput": 1.0, "schedlab": {"policy": "single_step"}}))
    monkeypatch.setattr(sys, "argv", ["aggregate", str(tmp_path)])
    aggregate.main()
    assert all((tmp_path / n).is_file() for n in AGGREGATE_FILES)
    assert unrecorded(tmp_path, AGGREGATE_FILES) == []
