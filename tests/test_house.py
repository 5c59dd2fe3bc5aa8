"""The house stays easy to change: no function in experiments/ over 80 lines and ``run`` under
60 (a run read as its steps), no module docstring of 60 lines (those belong in docs/), and no
code comment or docstring quoting a timing or a size measured on some machine (figures go in
BENCHMARKS.md, with the command, hardware and date, where they can be re-measured)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "policies", "simulator", "real_backend", "vllm_backend", "experiments",
            "benchmarks")
MAX_FUNCTION = 80
MAX_RUN = 60
MAX_MODULE_DOC = 60


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name, node.end_lineno - node.lineno + 1


def test_no_function_in_experiments_is_over_80_lines():
    long = []
    for path in sorted((ROOT / "experiments").rglob("*.py")):
        for name, lines in _functions(path):
            where = f"{path.relative_to(ROOT)}:{name}"
            if lines > MAX_FUNCTION:
                long.append(f"{where} ({lines} lines)")
    assert not long, "over 80 lines: " + ", ".join(long)


def test_run_reads_as_the_steps_of_a_run():
    lines = dict(_functions(ROOT / "experiments" / "run.py"))["run"]
    assert lines < MAX_RUN, f"experiments/run.py:run has {lines} lines"


def test_no_module_docstring_of_60_lines():
    long = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
            if doc and doc.count("\n") + 1 >= MAX_MODULE_DOC:
                long.append(str(path.relative_to(ROOT)))
    assert not long, "module docstrings for docs/: " + ", ".join(long)


# A figure with a unit, said of a run's size or of a machine: "0.14 GB at 1M", "12 s for 100k",
# "4-12 s on an H200", "(1M requests: 2.1 -> 0.85 s)".
MEASURED = re.compile(
    r"\d[\d.,]*\s*(?:-\s*\d[\d.]*\s*)?(?:s|ms|us|µs|MB|GB|GiB|MiB|x)\b[^.;\n]{0,40}?"
    r"\b(?:at|for|on)\s+(?:1M|\d+k|an? (?:H100|H200|\d-core))\b"
    r"|\b1M(?: requests)?: [\d.]+ ?-> ?[\d.]+ ?s")


def _comments_and_docstrings(path: Path):
    text = path.read_text()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING
                                            and tok.string.lstrip("rbuRBU").startswith('"""')):
            yield tok.start[0], tok.string


def test_no_comment_quotes_a_measurement():
    found = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for line, text in _comments_and_docstrings(path):
                for m in MEASURED.finditer(" ".join(text.split())):
                    found.append(f"{path.relative_to(ROOT)}:{line}: {m.group(0)!r}")
    assert not found, "measurements in code (they go in BENCHMARKS.md):\n" + "\n".join(found)
