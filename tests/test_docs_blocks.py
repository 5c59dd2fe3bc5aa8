"""Every code block of README.md and docs/ is run or checked here, so that a doc cannot rot (as
SimPy runs its examples). docs/README.md says the same to a doc's writer.

The fence says what a block is and how it is tested:

- ```` ```bash ````, ```` ```python ````, ```` ```yaml ````: a command or a file, run in full, the
  blocks of a doc in order in a fresh directory of their own (where ``docs/`` and
  ``benchmarks/``, ``examples/`` lead to the checkout's). A command ``python -m experiments.run`` runs in this
  process, each run cut to ``SIZE`` requests (``workload.num_prompts``, a multi-turn workload's
  ``num_conversations``), each job of a ``-m`` sweep too; another schedlab command line (``python
  -m experiments.X``, ``python docs/...py``) runs in this process with its arguments; a python
  block is executed; a yaml block is parsed.
- ```` ```python file=my_policy.py ````: a file the doc asks you to save: written under that
  name (its directories made) for the doc's next blocks, and compiled or parsed; the commands
  that name it run it.
- ```` ```bash needs=gpu,slow ````: not run here, for the reasons in ``NEEDS``; checked as far
  as a CPU allows: each Hydra command's overrides compose against conf/ (Hydra's compose API)
  and pass the run's own setting checks (a sweep's every job of its own config groups), each
  other schedlab command's arguments parse with its own parser, python compiles, YAML parses.
  Commands that are not schedlab's (pip, git, cd, a variable) are accepted only here.
- ```` ```text ````: output, a listing or a diagram: nothing to run.

A block without one of these, an unknown reason, or a command an unmarked block cannot run,
fails the test naming the file and line."""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import io
import os
import re
import runpy
import shlex
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import open_dict

from common.paths import conf_dir
from experiments.cli_checks import check_run_settings
from experiments.sweep_workers import split_jobs

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
NEEDS = {
    "gpu": "needs a GPU (or a model's weights)",
    "cluster": "needs a SLURM or Ray cluster",
    "network": "installs from the network",
    "slow": "takes more than a few seconds (a sweep, a real-engine or vLLM run, a benchmark)",
    "server": "serves until stopped, or needs a running server",
    "yours": "names files of your own (a trace, a config directory, run directories)",
    "checkout": "writes the checkout's own files (a bundled profile in conf/, the docs' tables)",
}
LANGUAGES = ("bash", "python", "yaml", "text")
SIZE = 16  # requests a documented run is cut to
HYDRA_APPS = {"experiments.run": "config", "experiments.serve": "serve"}
LINKED = ("docs", "benchmarks", "examples")  # the checkout's, in a doc's directory
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                   re.MULTILINE | re.DOTALL)


@dataclass
class Block:
    doc: Path
    line: int
    language: str
    needs: tuple[str, ...]
    file: str | None
    body: str

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    """The doc's fenced blocks, in order; a malformed fence's info string fails here."""
    text = doc.read_text()
    found = []
    for m in FENCE.finditer(text):
        words = m["info"].split()
        where = f"{doc.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
        assert words and words[0] in LANGUAGES, (
            f"{where}: a block says what it is: ```{'|'.join(LANGUAGES)} (got {m['info']!r})")
        attrs = dict(w.split("=", 1) for w in words[1:] if "=" in w)
        assert set(attrs) <= {"needs", "file"} and all("=" in w for w in words[1:]), (
            f"{where}: unknown fence attributes {words[1:]}; known: needs=, file=")
        needs = tuple(filter(None, attrs.get("needs", "").split(",")))
        assert set(needs) <= set(NEEDS), f"{where}: unknown needs {needs}; known: {list(NEEDS)}"
        body = "\n".join(line[len(m["indent"]):] for line in m["body"].splitlines())
        found.append(Block(doc, text.count("\n", 0, m.start()) + 1, words[0], needs,
                           attrs.get("file"), body))
    return found


def commands(block: Block) -> Iterator[list[str]]:
    """A bash block's commands as argument lists: continuation lines joined, quotes spanning
    lines kept together, comments dropped."""
    pending = ""
    for line in block.body.replace("\\\n", " ").splitlines():
        pending += line + "\n"
        try:
            argv = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on
            continue
        pending = ""
        if argv:
            yield argv
    assert not pending, f"{block.where}: a quote is never closed"


class Parsed(Exception):
    """A command line's arguments parsed by its own parser: it goes no further."""


@contextlib.contextmanager
def argv_of(argv: list[str]) -> Iterator[None]:
    saved = sys.argv
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv = saved


def run_cli(argv: list[str], *, parse_only: bool, where: str) -> None:
    """A schedlab command line that is not a Hydra app (python -m MODULE or python FILE.py),
    in this process: in full, or its arguments parsed by its own argparse parser only."""
    if argv[1] == "-m":
        target, args = argv[2], argv[3:]
        assert target.split(".")[0] in ("experiments", "benchmarks"), (
            f"{where}: {' '.join(argv)} is not a schedlab command line; mark the block")
        start = lambda: runpy.run_module(target, run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        target, args = argv[1], argv[2:]
        assert Path(target).is_file(), f"{where}: {target} does not exist"

        def start() -> None:  # as python FILE does: the script's directory first on sys.path
            sys.path.insert(0, str(Path(target).parent))
            try:
                runpy.run_path(target, run_name="__main__")
            finally:
                sys.path.remove(str(Path(target).parent))

    def parsed(self, *a, **k):
        original(self, *a, **k)
        raise Parsed

    original = argparse.ArgumentParser.parse_known_args
    with argv_of([target, *args]), contextlib.ExitStack() as stack:
        # a module the tests imported already runs again as __main__, as python -m runs it
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)
        if parse_only:  # parse_args calls parse_known_args
            stack.enter_context(pytest.MonkeyPatch.context()).setattr(
                argparse.ArgumentParser, "parse_known_args", parsed)
        try:
            start()
        except Parsed:
            return
        except SystemExit as exit_:
            assert exit_.code in (0, None), f"{where}: {' '.join(argv)} exited {exit_.code}"
    assert not parse_only, f"{where}: {' '.join(argv)} parsed no arguments"


@functools.lru_cache(maxsize=256)
def _composed(config_name: str, overrides: tuple[str, ...], cwd: str):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return compose(config_name, overrides=list(overrides))


def composed(config_name: str, overrides: list[str]):
    """The job's config, composed once per test process (the docs repeat commands); a search
    path relative to the working directory is composed there."""
    cwd = os.getcwd() if any(a.startswith("hydra.searchpath") for a in overrides) else ""
    return copy.deepcopy(_composed(config_name, tuple(overrides), cwd))


def run_hydra(argv: list[str], *, needs: tuple[str, ...], where: str, runs: list[int]) -> None:
    """python -m experiments.run/serve (or schedlab-run): each job composed and checked as its
    run checks it; in full, each run in this process with at most SIZE requests."""
    from experiments.run import run

    app = argv[2] if argv[0] == "python" else "experiments.run"
    args = argv[3:] if argv[0] == "python" else argv[1:]
    multirun = "-m" in args or "--multirun" in args
    args = [a for a in args if a not in ("-m", "--multirun")]
    assert all(not a.startswith("-") for a in args), f"{where}: flags {args}"
    if "yours" in needs:  # a placeholder (<partition>, $m, ...) composes nothing: syntax only
        from hydra.core.override_parser.overrides_parser import OverridesParser

        OverridesParser.create().parse_overrides(
            [re.sub(r"<[^>]*>|\$\w+", "X", a) for a in args if a != "..."])
        return
    if "network" in needs:  # the launcher plugin it installs is not here: the rest composes
        args = [a for a in args if not a.lstrip("+").startswith(("hydra/launcher=",
                                                                 "hydra.launcher."))]
    jobs = split_jobs(args) if multirun else [args]
    assert multirun or len(jobs) == 1, f"{where}: a sweep without -m: {args}"
    check_only = bool(needs)
    if check_only:  # every job of its own config groups, and the last job
        groups = {}
        for job in jobs:
            groups.setdefault(tuple(a for a in job if "." not in a.partition("=")[0]), job)
        jobs = [*groups.values(), jobs[-1]]
    for job in jobs:
        run_dir = next((a.partition("=")[2] for a in job if a.startswith("hydra.run.dir=")),
                       None)
        try:
            cfg = composed(HYDRA_APPS[app], job)
        except Exception as err:
            raise AssertionError(f"{where}: {' '.join(argv)}: {err}") from None
        with open_dict(cfg):
            cfg.progress = False
            for key in ("num_prompts", "num_conversations"):
                if key in cfg.workload:  # null: the whole trace
                    value = cfg.workload[key]
                    cfg.workload[key] = SIZE if value is None else min(int(value), SIZE)
        if not check_only:  # the run checks its settings itself
            assert app == "experiments.run", f"{where}: {app} serves until stopped: mark it"
            assert not run_dir or not Path(run_dir).is_absolute(), (
                f"{where}: a run the tests run writes below the doc's directory, not {run_dir}")
            runs[0] += 1
            try:
                run(cfg, Path(run_dir or f"outputs/run-{runs[0]}"))
            except (ValueError, TypeError, OSError) as err:  # a bad setting: the run's line
                raise AssertionError(f"{where}: {' '.join(job)}: {err}") from None
            continue
        try:
            if app == "experiments.serve":
                from experiments.serve import check_server

                check_server(cfg)
                with open_dict(cfg):
                    del cfg["server"]
            check_run_settings(cfg)
        except (ValueError, TypeError, OSError) as err:
            raise AssertionError(f"{where}: {' '.join(job)}: {err}") from None


SHELL = ("pip", "git", "cd", ".", "for", "done", "sbatch", "squeue")


def run_command(argv: list[str], block: Block, runs: list[int]) -> None:
    where = f"{block.where} ({' '.join(argv)[:80]})"
    check_only = bool(block.needs)
    if argv[0] == "schedlab-run" or argv[:2] == ["python", "-m"] and argv[2] in HYDRA_APPS:
        run_hydra(argv, needs=block.needs, where=where, runs=runs)
    elif argv[0] == "python" and argv[1] == "-c":
        compile(argv[2], where, "exec")
        assert check_only, f"{where}: python -c is not run here: mark the block"
    elif argv[0] == "python" and (argv[1].endswith(".py") or argv[1] == "-m" and
                                  argv[2].split(".")[0] in ("experiments", "benchmarks")):
        run_cli(argv, parse_only=check_only, where=where)
    elif all(re.match(r"[+~]*[\w./-]+=", a) for a in argv):  # overrides to add to a command
        from hydra.core.override_parser.overrides_parser import OverridesParser

        assert check_only, f"{where}: overrides alone do not run: mark the block"
        OverridesParser.create().parse_overrides([re.sub(r"<[^>]*>", "X", a) for a in argv])
    else:  # pip, git, cd, a variable, another program's command line
        assert check_only, f"{where}: not a schedlab command: mark the block (needs=...)"
        assert argv[0] in (*SHELL, "python") or re.match(r"\w+=", argv[0]), (
            f"{where}: unknown command {argv[0]}")


def doc_directory(tmp_path: Path) -> Path:
    for name in LINKED:
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


@contextlib.contextmanager
def registries_kept() -> Iterator[None]:
    """The registries and modules a doc's policy or router file adds are gone after it."""
    from policies.base import _IMPORTED, POLICIES
    from policies.routers import ROUTERS

    saved = dict(POLICIES), dict(ROUTERS), dict(_IMPORTED), set(sys.modules)
    try:
        yield
    finally:
        for registry, kept in zip((POLICIES, ROUTERS, _IMPORTED), saved[:3], strict=True):
            registry.clear()
            registry.update(kept)
        for name in set(sys.modules) - saved[3]:
            if name.split(".")[0] not in ("experiments", "policies", "simulator", "common"):
                module = sys.modules[name]
                if str(getattr(module, "__file__", "") or "").startswith(os.getcwd()):
                    del sys.modules[name]


def run_block(block: Block, runs: list[int]) -> str:
    """Run or check one block in the current directory; what was done, for the report."""
    if block.file:
        path = Path(block.file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(block.body)
    if block.language == "text":
        return "text"
    if block.language == "yaml":
        yaml.safe_load(block.body)
        return "parsed"
    if block.language == "python":
        code = compile(block.body, block.where, "exec")
        if block.needs or block.file:
            return "compiled"
        exec(code, {"__name__": "doc_block"})  # noqa: S102
        return "executed"
    for argv in commands(block):
        run_command(argv, block, runs)
    return "checked" if block.needs else "run"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_block_of_the_doc_runs_or_is_marked_and_checked(doc, tmp_path, monkeypatch):
    monkeypatch.chdir(doc_directory(tmp_path))
    runs = [0]
    before = conf_files()
    with registries_kept(), contextlib.redirect_stdout(io.StringIO()):
        for block in blocks(doc):
            run_block(block, runs)
    GlobalHydra.instance().clear()
    # a command that writes the checkout's configs (fit_api's default --name) is marked
    assert conf_files() == before, "a block wrote into conf/: mark it needs=checkout"


def conf_files() -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in (ROOT / "conf").rglob("*") if p.is_file()}


def test_the_policy_yaml_of_your_own_policy_is_accepted_by_make_policy(tmp_path, monkeypatch):
    """docs/policies.md's YAML had overlap: and overlap_late_schedule:, which make_policy
    refuses (they are scheduler.* settings): its file and YAML build the policy as written."""
    from policies import make_policy

    monkeypatch.chdir(tmp_path)
    files = {b.file: b for b in blocks(ROOT / "docs" / "policies.md") if b.file}
    with registries_kept():
        for block in files.values():
            run_block(block, [0])
        settings = yaml.safe_load(Path("my_conf/policy/short_prompt_first.yaml").read_text())
        policy = make_policy(**settings)
    assert policy.name == "short_prompt_first" and policy.max_long == 4


def test_a_failing_unmarked_block_fails_and_an_unmarked_shell_command_is_refused(tmp_path,
                                                                                monkeypatch):
    monkeypatch.chdir(tmp_path)
    doc = tmp_path / "doc.md"
    doc.write_text("```bash\npython -m experiments.run policy.num_steps=0\n```\n"
                   "```bash\npip install schedlab\n```\n"
                   "```bash needs=network\npip install schedlab\n```\n"
                   "```\nno language\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="says what it is"):
        blocks(doc)
    doc.write_text(doc.read_text().rsplit("```\nno", 1)[0])
    bad, shell, marked = blocks(doc)
    with pytest.raises(AssertionError, match=r"doc.md:1 .*num_steps must be an integer >= 1"):
        run_block(bad, [0])
    with pytest.raises(AssertionError, match="mark the block"):
        run_block(shell, [0])
    assert run_block(marked, [0]) == "checked"
