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
    for pkg in ("common", "policies", "simulator", "real_backend", "vllm_backend", "experiments",
                "benchmarks"):
        for path in (root / pkg).rglob("*.py"):  # subpackages too (experiments/workload/)
            if path.name == "__init__.py" or "__pycache__" in path.parts:
                continue
            assert f"`{path.name}`" in doc or f"`{path.stem}.py`" in doc, f"{pkg}/{path.name}"


LAYERS = {"common": 0, "policies": 1, "simulator": 2, "real_backend": 2, "vllm_backend": 2,
          "experiments": 3, "benchmarks": 4}


def import_graph(type_only: bool = False) -> dict[str, set[str]]:
    """Module -> the project modules it imports (at any depth in the module, TYPE_CHECKING
    blocks aside: those imports never run; with ``type_only``, theirs too)."""
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
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                       for n in ast.walk(node)} if not type_only else set()
        targets = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {resolve(f"{node.module}.{a.name}") or resolve(node.module)
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
    assert_no_cycle(import_graph())


def test_policies_has_no_cycle_through_type_only_imports_either():
    """Inside policies/ the layers hold for type hints too (requests below the policy
    interface, the interface below the scheduler), but for one mutual reference: a policy's
    hooks are given the Scheduler that calls them, so their type-only imports of it stay."""
    runs, hints = import_graph(), import_graph(type_only=True)
    graph = {m: {t for t in targets if t.startswith("policies.")
                 and (t in runs[m] or t != "policies.scheduler")}
             for m, targets in hints.items() if m.startswith("policies.")}
    assert_no_cycle(graph)


def assert_no_cycle(graph: dict[str, set[str]]) -> None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
