"""Model, scheduler and policy settings: wrong types, out-of-range values and unknown keys are
one-line errors that name the setting, never a silently rounded or ignored value."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from policies import ModelSpec, SchedulerConfig, make_policy

ROOT = Path(__file__).resolve().parent.parent
TINY = yaml.safe_load((ROOT / "conf/model/tiny.yaml").read_text())


@pytest.mark.parametrize(("change", "message"), [
    ({"num_layers": 1.5}, r"model\.num_layers must be an integer >= 1, got 1\.5"),
    ({"num_layers": 2.0}, r"model\.num_layers must be an integer >= 1, got 2\.0"),
    ({"hidden_size": "64"}, r"model\.hidden_size must be an integer"),
    ({"num_heads": True}, r"model\.num_heads must be an integer"),
    ({"dtype_bytes": 0}, r"model\.dtype_bytes must be an integer >= 1, got 0"),
    ({"dtype_bytes": -2}, r"model\.dtype_bytes must be an integer >= 1, got -2"),
    ({"head_dim": -1}, r"model\.head_dim must be an integer >= 0"),
    ({"rope_theta": float("nan")}, r"model\.rope_theta must be a finite number"),
    ({"rms_norm_eps": 0.0}, r"model\.rms_norm_eps must be > 0"),
    ({"tie_word_embeddings": "no"}, r"model\.tie_word_embeddings must be true or false"),
    ({"num_layer": 2}, r"model has no setting 'num_layer'; its settings: .*num_layers"),
    ({"name": None}, r"model\.name must be a non-empty name"),
])
def test_bad_model_settings(change, message):
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_dict({**TINY, **change})


def test_model_conf_files_load():
    for path in sorted((ROOT / "conf/model").glob("*.yaml")):
        spec = ModelSpec.from_dict(yaml.safe_load(path.read_text()))
        assert spec.name == path.stem and spec.weight_bytes > 0


@pytest.mark.parametrize(("change", "message"), [
    ({"max_num_seqs": 2.5}, r"scheduler\.max_num_seqs must be an integer >= 1, got 2\.5"),
    ({"max_num_batched_tokens": 1000.5}, r"scheduler\.max_num_batched_tokens must be an integer"),
    ({"block_size": "16"}, r"scheduler\.block_size must be an integer"),
    ({"watermark": float("nan")}, r"scheduler\.watermark must be a finite number"),
    ({"watermark": 1.0}, r"scheduler\.watermark must be in \[0, 1\)"),
    ({"max_num_seq": 8}, r"scheduler has no setting 'max_num_seq'"),
])
def test_bad_scheduler_settings(change, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig.from_dict(change)


@pytest.mark.parametrize(("name", "params", "message"), [
    ("adaptive", {"overhead_steps": float("nan")}, r"policy\.overhead_steps must be a finite"),
    ("adaptive", {"overhead_steps": float("inf")}, r"policy\.overhead_steps must be a finite"),
    ("adaptive", {"overhead_steps": -1.0}, r"policy\.overhead_steps must be >= 0"),
    ("adaptive", {"arrivals_per_window": float("nan")}, r"policy\.arrivals_per_window must be"),
    ("adaptive", {"min_steps": 1.5}, r"policy\.min_steps must be an integer >= 1"),
    ("multi_step", {"num_steps": 8.0}, r"policy\.num_steps must be an integer >= 1, got 8\.0"),
    ("cp1", {"num_step": 8}, r"policy cp1 has no setting 'num_step'"),
])
def test_bad_policy_settings(name, params, message):
    with pytest.raises(ValueError, match=message):
        make_policy(name, **params)


@pytest.mark.parametrize(("override", "message"), [
    ("model.num_layers=1.5", "model.num_layers must be an integer >= 1, got 1.5"),
    ("+model.num_layer=2", "model has no setting 'num_layer'"),
    ("scheduler.max_num_seqs=2.5", "scheduler.max_num_seqs must be an integer >= 1, got 2.5"),
    ("policy=adaptive policy.overhead_steps=nan", "policy.overhead_steps must be a finite number"),
])
def test_run_refuses_bad_settings_in_one_line(tmp_path, override, message):
    """The first through the CLI: exit 2, one line on stderr, and no result written; the others
    through run() in this process (the CLI's line is the message of the error run() raises)."""
    out = tmp_path / "run"
    settings = ["workload=synthetic", "workload.num_prompts=4", "model=tiny", "hardware=cpu",
                "overhead=none", "progress=false", *override.split()]
    if override == "model.num_layers=1.5":
        proc = subprocess.run(
            [sys.executable, "-m", "experiments.run", *settings, f"hydra.run.dir={out}"],
            cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], proc.stderr
    else:
        from hydra import compose, initialize_config_dir

        from experiments.run import CONF_DIR, run

        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            cfg = compose("config", overrides=settings)
        with pytest.raises((ValueError, TypeError)) as err:
            run(cfg, out)
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not (out / "result.json").exists()
