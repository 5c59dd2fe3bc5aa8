"""A non-editable install (`pip install .`) carries every config file and runs from any
directory (docs/install.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what a build reads: pyproject.toml, the README it names, the packages and the configs
SOURCES = ("pyproject.toml", "README.md", "common", "policies", "simulator", "real_backend",
           "vllm_backend", "experiments", "conf")


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(the copied source tree, the --target directory it was installed into). The build runs
    on a copy, so it never writes build/ or egg-info into the checkout, and with the packages
    installed here (--no-deps, --no-index), so nothing is downloaded."""
    tmp = tmp_path_factory.mktemp("install")
    src, target = tmp / "src", tmp / "site"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():  # symlinks=True: experiments/conf stays the link the build follows
            shutil.copytree(path, src / name, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                          "--no-build-isolation", "--no-index", "--target", str(target), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return src, target


def test_installed_package_carries_every_config_file(installed):
    src, target = installed
    shipped = target / "experiments" / "conf"
    assert shipped.is_dir() and not shipped.is_symlink()  # files, not a link back to a checkout
    assert _files(shipped) == _files(src / "conf")  # calibration tables (csv, json) included


def test_installed_run_works_from_another_directory(installed, tmp_path):
    """`python -m experiments.run` and `schedlab-run` with only the installed copy importable
    (PYTHONPATH is the install; the working directory is neither it nor the checkout), on a
    profile priced from the shipped operator tables (conf/calibration/h200_ops)."""
    _, target = installed
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run([sys.executable, "-c", "from common.paths import conf_dir; "
                            "import simulator.op_cost as o; print(conf_dir()); print(o.CONF_DIR)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert where.stdout.split() == [str(target / "experiments" / "conf")] * 2, where.stderr

    run = subprocess.run([sys.executable, "-m", "experiments.run", "workload=synthetic",
                          "workload.num_prompts=20", "hardware=h200_ops", "progress=false",
                          "hydra.run.dir=run"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["completed"] == 20 and result["schedlab"]["hardware"] == "h200_ops"

    # the console script: Hydra finds the installed package's primary config directory
    script = subprocess.run([str(target / "bin" / "schedlab-run"), "--cfg", "job", "-p", "policy"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert script.returncode == 0, script.stderr[-3000:]
    assert "name: multi_step" in script.stdout
