"""The core stays backend-free: policies/ imports nothing from simpy, torch, hydra or the executors."""

from __future__ import annotations

import ast
from pathlib import Path

FORBIDDEN = {"simpy", "torch", "triton", "hydra", "omegaconf", "simulator", "real_backend",
             "experiments"}


def test_policies_import_nothing_from_backends():
    root = Path(__file__).resolve().parent.parent / "policies"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"


def test_every_module_has_a_line_in_architecture_doc():
    root = Path(__file__).resolve().parent.parent
    doc = (root / "docs" / "architecture.md").read_text()
    for pkg in ("policies", "simulator", "real_backend", "experiments", "benchmarks"):
        for path in (root / pkg).rglob("*.py"):  # subpackages too (experiments/workload/)
            if path.name == "__init__.py" or "__pycache__" in path.parts:
                continue
            assert f"`{path.name}`" in doc or f"`{path.stem}.py`" in doc, f"{pkg}/{path.name}"
