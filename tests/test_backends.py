"""The backends behind one interface (experiments/backends.py): experiments/run.py asks no
backend its name, and steps.csv's rows begin with the one window record
(common/window_record.py) whichever backend filled them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from common.window_record import WINDOW_COLUMNS
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
