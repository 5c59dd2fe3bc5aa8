"""The backends behind one interface (experiments/backends.py): experiments/run.py asks no
backend its name, and steps.csv's rows begin with the one window record
(common/window_record.py) whichever backend filled them, the stages the simulator and the real
engine both time under the same columns after it."""

from __future__ import annotations

import ast
import csv
from pathlib import Path

import pytest

from common.window_record import STAGE_COLUMNS, WINDOW_COLUMNS
from experiments.backends import BACKENDS, backend_class

ROOT = Path(__file__).resolve().parents[1]


def test_run_has_no_branch_on_a_backends_name():
    tree = ast.parse((ROOT / "experiments" / "run.py").read_text())
    names = set(BACKENDS)
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            consts = {n.value for n in [node.left, *node.comparators]
                      if isinstance(n, ast.Constant)}
            assert not consts & names, f"run.py line {node.lineno} compares with {consts & names}"
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            assert node.slice.value != "name" or not (
                isinstance(node.value, ast.Name) and node.value.id == "backend"), \
                f"run.py line {node.lineno} reads backend['name']"


def test_an_unknown_backend_is_one_line():
    with pytest.raises(ValueError, match=r"^backend\.name must be one of sim, real, vllm, "
                                         r"got 'gpu'$"):
        backend_class({"backend": {"name": "gpu"}})


def test_the_simulators_steps_begin_with_the_window_record(tmp_path):
    from hydra import compose, initialize_config_dir

    from common.paths import conf_dir
    from experiments.run import run

    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose("config", overrides=["workload=synthetic", "workload.num_prompts=4",
                                           "progress=false"])
    run(cfg, tmp_path, sweep_label="test")
    header = (tmp_path / "steps.csv").read_text().splitlines()[0].split(",")
    assert header[0] == "virtual_engine"
    assert tuple(header[1:1 + len(WINDOW_COLUMNS)]) == WINDOW_COLUMNS


def _steps(tmp_path, name, *overrides):
    from hydra import compose, initialize_config_dir

    from common.paths import conf_dir
    from experiments.run import run

    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose("config", overrides=["workload=synthetic", "workload.num_prompts=4",
                                           "model=tiny", "progress=false", *overrides])
    run(cfg, tmp_path / name, sweep_label=name)
    with open(tmp_path / name / "steps.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_the_backends_steps_have_the_same_columns_for_the_same_stage(tmp_path):
    """The simulator's steps.csv and the real engine's: the record, then the same stage
    columns (the CPU before the GPU, the GPU's window and steps), then each one's own; the real
    engine's CPU before the GPU is its scheduling plus its preparing."""
    pytest.importorskip("torch")
    shared = (*WINDOW_COLUMNS, *STAGE_COLUMNS)
    sim = _steps(tmp_path, "sim", "hardware=cpu", "overhead=none")
    real = _steps(tmp_path, "real", "backend=real", "backend.device=cpu")
    assert tuple(sim[0])[1:1 + len(shared)] == shared
    assert tuple(real[0])[:len(shared)] == shared
    for row in real:
        assert float(row["schedule_prepare_s"]) == pytest.approx(
            float(row["schedule_s"]) + float(row["prepare_s"]))
        steps = row["gpu_step_s"].split(";")
        assert len(steps) == int(row["k"])
        assert float(row["gpu_s"]) == pytest.approx(sum(map(float, steps)), abs=1e-5)


def test_a_clusters_replica_load_is_read_by_name():
    """simulator.cluster.replica_summaries reads each window's replica and KV use by name
    from the StepRows (not by position): a row's load read back is the load stored."""
    from simulator.outcome import STORED_FIELDS, StepRows, step_row

    steps = StepRows(True, [step_row(0, tuple(range(len(WINDOW_COLUMNS))), 0.5, (0.1, 0.2),
                                     (2, 7, 3, 4, 99))])
    assert len(steps.rows[0]) == len(STORED_FIELDS)
    assert steps.column("replica") == [2] and steps.column("kv_blocks_used") == [99]
    row = steps[0]
    assert (row["replica"], row["outstanding"], row["kv_blocks_used"]) == (2, 7, 99)
    assert (row["schedule_prepare_s"], row["gpu_step_s"]) == (0.5, "0.100000;0.200000")
