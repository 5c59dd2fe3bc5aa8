"""The core stays backend-free: policies/ imports nothing from simpy, torch, hydra or the executors."""

from __future__ import annotations

import ast
import functools
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
    for pkg in ("common", "policies", "simulator", "real_backend", "vllm_backend", "experiments",
                "benchmarks"):
        for path in (root / pkg).rglob("*.py"):  # subpackages too (experiments/workload/)
            if path.name == "__init__.py" or "__pycache__" in path.parts:
                continue
            assert f"`{path.name}`" in doc or f"`{path.stem}.py`" in doc, f"{pkg}/{path.name}"


LAYERS = {"common": 0, "policies": 1, "simulator": 2, "real_backend": 2, "vllm_backend": 2,
          "experiments": 3, "benchmarks": 4}


@functools.cache
def import_graph(typing: bool = False) -> dict[str, set[str]]:
    """Module -> the project modules it imports (at any depth in the module; TYPE_CHECKING
    blocks aside, as those imports never run, unless ``typing``). A benchmark's import of a
    module beside it (``from op_timing import ...``: benchmarks/ runs its scripts with their
    directory on the path) is the import of that module. Built once per test process (the
    tests only read it): each build parses every module of the project."""
    root = Path(__file__).resolve().parent.parent
    modules = {}
    for pkg in LAYERS:
        for path in (root / pkg).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        typing_only = set() if typing else {
            id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
            for n in ast.walk(node)}
        beside = name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                module = node.module
                if name.startswith("benchmarks.") and f"{beside}.{module}" in modules:
                    module = f"{beside}.{module}"
                targets |= {resolve(f"{module}.{a.name}") or resolve(module)
                            for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {resolve(a.name) for a in node.names}
        graph[name] = {t for t in targets if t and t != name}
    return graph


def test_every_package_imports_only_the_layers_below_it():
    for module, targets in import_graph().items():
        layer, pkg = LAYERS[module.split(".")[0]], module.split(".")[0]
        for target in targets:
            other = target.split(".")[0]
            assert LAYERS[other] < layer or other == pkg, f"{module} imports {target}"


def test_the_import_graph_has_no_cycle():
    cycle = _a_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_policies_has_no_cycle_through_type_only_imports_either():
    """Inside policies/ the layers hold for type hints too (requests below the policy
    interface, the interface below the scheduler), but for one mutual reference: a policy's
    hooks are given the Scheduler that calls them, so their type-only imports of it stay."""
    runs, hints = import_graph(), import_graph(typing=True)
    graph = {m: {t for t in targets if t.startswith("policies.")
                 and (t in runs[m] or t != "policies.scheduler")}
             for m, targets in hints.items() if m.startswith("policies.")}
    cycle = _a_cycle(graph)
    assert cycle is None, "import cycle in policies/: " + " -> ".join(cycle or [])



# policies/ keeps one mutual reference through type hints, a policy's hooks being given the
# Scheduler that calls them: the test above checks it for every other cycle.
CYCLES_BEING_SPLIT = {"policies"}


def test_no_package_imports_itself_in_a_cycle():
    """No cycle among one package's modules, TYPE_CHECKING imports counted: an import made
    for annotations only hides a cycle (the modules still cannot be read, or split, one
    without the other) rather than removing it."""
    graph = import_graph(typing=True)
    for pkg in LAYERS:
        inside = {m: {t for t in ts if t.split(".")[0] == pkg}
                  for m, ts in graph.items() if m.split(".")[0] == pkg}
        cycle = _a_cycle(inside)
        if pkg in CYCLES_BEING_SPLIT:
            continue
        assert cycle is None, f"import cycle in {pkg}/: " + " -> ".join(cycle or [])


def _a_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its modules in order, the first again at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target, path + [target])):
                return found
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module, [module])):
            return found
    return None


def test_common_imports_nothing_above_it_even_for_annotations():
    for module, targets in import_graph(typing=True).items():
        if module.split(".")[0] == "common":
            above = sorted(t for t in targets if t.split(".")[0] != "common")
            assert not above, f"{module} imports {above}"


def test_a_real_backend_runs_choices_do_not_start_the_simulator():
    """Building a real-engine run's choices (its policy priced by a hardware profile of
    operator tables) loads the cost model alone: not the simulator's engine, SimPy, or the
    operator tables' modules."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    code = (
        "import sys\n"
        "from hydra import compose, initialize_config_dir\n"
        "from experiments.run import CONF_DIR, RunPlan\n"
        "with initialize_config_dir(config_dir=CONF_DIR, version_base=None):\n"
        "    cfg = compose('config', overrides=['backend=real', 'model=tiny',\n"
        "                                       'hardware=h200_ops', 'policy=sarathi'])\n"
        "RunPlan.of(cfg)\n"
        "print(sorted(m for m in sys.modules if m in ('simpy', 'simulator.engine',\n"
        "             'simulator.op_cost', 'simulator.op_tables')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]"
